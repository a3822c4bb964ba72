"""The Ray Serve deployment: one pool per replica over the node's one prepared copy of a model.

:class:`ModelServer` is a plain class (Ray is imported only when it runs in a replica or when
:func:`deployment` wraps it), so it imports anywhere and can be subclassed.

Decisions:

- The pool merges the requests a replica holds (batching ``"auto"``), so Serve must let enough
  requests reach the replica: ``max_ongoing_requests`` defaults to ``sessions x (max batch rows
  + 1)``, and ``sessions x 2`` without batching (Serve's own default, 5, would cap every batch
  at 5 requests; requests over the limit wait in the caller's router, which sends them to
  whichever replica frees up).
- Bad input is the caller's: ``InvalidInputError`` (and malformed bodies) become HTTP 400 with
  ``{"error": message}``, and reach handle callers as the ``InvalidInputError`` itself (Ray
  wraps it in a ``RayTaskError`` that is also an ``InvalidInputError``). Nothing about a bad
  request touches the pool's sessions.
- ``RunError`` is 500 (the model failed), ``PoolClosedError`` 503 (the replica is stopping).
  A replica that dies is Serve's to replace; its in-flight requests fail (``ActorDiedError``
  through a handle, 500 through HTTP), and the replacement maps the node's prepared file.
- Serve's health check fails once the pool is closed, so Serve replaces such a replica.
- HTTP is answered by the same code as ``sharedml serve`` (:mod:`sharedml.serve._http`): a
  body is reserved against the replica's :class:`HttpLimits` budget before it is read, parsed
  off the replica's event loop (where Serve also runs its health checks), and its bytes stay
  reserved until its reply is written.
- The replica's internal gRPC server listens on the node's address only (127.0.0.1 on a node
  started on loopback), not on every interface: :func:`sharedml.ray.restrict_replica_grpc`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sharedml._errors import InvalidInputError, PoolClosedError
from sharedml.pool._batching import Batching
from sharedml.pool._options import DEFAULT_SESSIONS, PoolOptions
from sharedml.protocol._admission import HttpLimits, InflightBytes
from sharedml.ray._loopback import restrict_replica_grpc
from sharedml.ray._metrics import PoolMetrics
from sharedml.ray._node import BatchingSetting, create_pool, mapped_files
from sharedml.serve._grpc import InferenceGrpc, grpc_failure
from sharedml.serve._http import InferenceHttp
from sharedml.serve._models import ServedModel

__all__ = ["GRPC_SERVICER", "ModelServer", "deployment"]

# What Serve's gRPC proxy needs to serve inference.GRPCInferenceService (the Open Inference
# Protocol over gRPC): serve.start(grpc_options={"port": ..., "grpc_servicer_functions":
# [GRPC_SERVICER]}); the proxy then routes each RPC to ModelServer's method of the same name.
GRPC_SERVICER = "sharedml.serve._grpc.add_GRPCInferenceServiceServicer_to_server"

_CLOSE_TIMEOUT_S = 30.0  # seconds a stopping replica waits for its runs in flight
_log = logging.getLogger("ray.serve")  # a replica's log: Serve keeps and shows it


def _model_name(model: str | os.PathLike[str] | bytes) -> str:
    return "model" if isinstance(model, bytes) else Path(model).stem


class ModelServer:
    """A Ray Serve replica serving one model from a :class:`~sharedml.SessionPool`.

    Deploy it with :func:`deployment`, or subclass it and wrap it with ``serve.deployment``.

    Handle calls (numpy in, numpy out)::

        outputs = handle.remote({"input": x}).result()              # {"output": array}
        outputs = handle.infer.remote({"input": x}, ["output"]).result()

    HTTP (relative to the application's route prefix): ``POST /`` with JSON, ``.npy`` or
    ``.npz`` (see :mod:`sharedml.serve._http`); the Open Inference Protocol's
    ``POST /v2/models/<name>/infer``, ``GET /v2/models/<name>``, ``GET /v2/models/<name>/ready``,
    ``GET /v2/health/live`` and ``GET /v2/health/ready``.

    Args:
        model: Path of any ONNX model, valid on every node (shared storage, or the same path
            on each), or its bytes.
        sessions: Sessions in each replica's pool (default: the pool's), or ``"auto"``: each
            replica splits its CPUs into sessions x threads by measuring (see
            :func:`sharedml.ray.create_pool`).
        batching: See :func:`sharedml.ray.create_pool`.
        providers: As for ``SessionPool``.
        model_name: The name clients use (default: the model file's stem).
        local_copy: See :func:`sharedml.ray.prepare_on_node`.
        cache_dir: The node's cache folder (default: ``$SHAREDML_CACHE_DIR`` on the node, then
            the user's cache folder).
        pool_options: Any other ``SessionPool`` argument (picklable).
        http_limits: What HTTP bodies may hold (default: :class:`HttpLimits`'s defaults).
        internal_grpc_host: Where the replica's internal gRPC server listens, inside Serve:
            ``"node"`` (default), an address, or None for Ray's default (every interface);
            see :func:`sharedml.ray.restrict_replica_grpc`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes,
        *,
        sessions: int | Literal["auto"] | None = None,
        batching: BatchingSetting = "auto",
        providers: Any = None,
        model_name: str | None = None,
        local_copy: bool | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        pool_options: Mapping[str, Any] | None = None,
        http_limits: HttpLimits | None = None,
        internal_grpc_host: str | None = "node",
    ) -> None:
        start = time.perf_counter()
        self.http_limits = http_limits or HttpLimits()
        self.inflight = InflightBytes(self.http_limits.max_inflight_bytes)
        self._identity = _replica_identity()
        # Serve starts the replica's gRPC server once this constructor returns.
        self.internal_grpc_host = (
            restrict_replica_grpc(internal_grpc_host) if self._identity else None
        )
        self.pool, self.node = create_pool(
            model,
            sessions=sessions,
            batching=batching,
            providers=providers,
            cache_dir=cache_dir,
            local_copy=local_copy,
            **dict(pool_options or {}),
        )
        self.start_seconds = time.perf_counter() - start
        self.model_name = model_name or _model_name(model)
        self.metrics = PoolMetrics(
            {
                "model": self.model_name,
                "application": self._identity.get("application", ""),
                "deployment": self._identity.get("deployment", ""),
                "replica": self._identity.get("replica", ""),
            }
        )
        self.served = ServedModel(self.model_name, self.pool, on_run=self._record)
        self.inputs = self.served.inputs
        self.outputs = self.served.outputs
        # The same routes, codecs and limits as `sharedml serve`: sharedml.serve._http.
        self.http = InferenceHttp(
            {self.model_name: self.served},
            version=_version(),
            limits=self.http_limits,
            budget=self.inflight,
        )
        self.grpc = InferenceGrpc(
            {self.model_name: self.served},
            version=_version(),
            limits=self.http_limits,
            budget=self.inflight,
        )
        self.metrics.record(self.pool.stats())
        _log.info("sharedml: model '%s': %s", self.model_name, self.pool.batching_reason)

    def _record(self, latency_s: float) -> None:
        self.metrics.record(self.pool.stats(), latency_s=latency_s)

    # ----------------------------------------------------------------------------------------
    # Handle API

    async def infer(
        self, feed: Mapping[str, Any], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the model on ``feed``; returns the outputs by name.

        Raises:
            InvalidInputError: the feed does not fit the model's inputs.
            RunError: onnxruntime failed the run.
            PoolClosedError: the replica is stopping.
        """
        return await self.served.infer(feed, output_names)

    async def __call__(self, request: Any) -> Any:
        """An HTTP request, or a handle call with a feed (a mapping of arrays)."""
        from starlette.requests import Request  # a Mapping too (of its ASGI scope): test first

        if isinstance(request, Request):
            return await self._http(request)
        if not isinstance(request, Mapping):
            raise InvalidInputError(
                f"A handle call takes a feed, a mapping of input names to arrays, not "
                f"{type(request).__name__}: handle.remote({{'{next(iter(self.inputs))}': x}})."
            )
        return await self.infer(request)

    def info(self) -> dict[str, Any]:
        """This replica: process, node, where its weights come from, and its pool's counters.

        ``mapped`` lists the files under the node's cache that the process maps (Linux): the
        prepared (or prepacked) files every replica of the node shares.
        """
        cache = Path(os.path.realpath(self.node.cache_dir))  # /proc/<pid>/maps has real paths
        return {
            **self._identity,
            "pid": os.getpid(),
            "model_name": self.model_name,
            "node_model": self.node.to_dict(),
            "start_seconds": self.start_seconds,
            "mechanism": str(self.pool.mechanism),
            "batching": dataclasses.asdict(self.pool.batching) if self.pool.batching else None,
            "batching_reason": self.pool.batching_reason,
            "mapped": [str(p) for p in mapped_files() if p.is_relative_to(cache)],
            "stats": dataclasses.asdict(self.pool.stats()),
            "internal_grpc_host": self.internal_grpc_host,
            "inflight_bytes": self.inflight.used_bytes,
        }

    def check_health(self) -> None:
        """Serve's health check: a replica whose pool is closed is replaced."""
        if self.pool.closed:
            raise PoolClosedError(f"The pool of model '{self.model_name}' is closed.")

    def __del__(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close(timeout_s=_CLOSE_TIMEOUT_S)

    # ----------------------------------------------------------------------------------------
    # HTTP

    async def _http(self, request: Any) -> Any:
        return await self.http.handle(request)

    # ----------------------------------------------------------------------------------------
    # gRPC: inference.GRPCInferenceService through Serve's gRPC proxy (see GRPC_SERVICER)

    async def _grpc(self, method: str, request: Any, context: Any) -> Any:
        try:
            return await getattr(self.grpc, method)(request)
        except Exception as exc:
            failure = grpc_failure(exc)
            if failure is not None and context is not None:
                # Serve answers with the code set on its context when the method raises.
                context.set_code(failure[0])
                context.set_details(failure[1])
            raise

    async def ServerLive(self, request: Any, grpc_context: Any = None) -> Any:
        """The Open Inference Protocol's ServerLive RPC."""
        return await self._grpc("ServerLive", request, grpc_context)

    async def ServerReady(self, request: Any, grpc_context: Any = None) -> Any:
        """The Open Inference Protocol's ServerReady RPC."""
        return await self._grpc("ServerReady", request, grpc_context)

    async def ModelReady(self, request: Any, grpc_context: Any = None) -> Any:
        """The Open Inference Protocol's ModelReady RPC."""
        return await self._grpc("ModelReady", request, grpc_context)

    async def ServerMetadata(self, request: Any, grpc_context: Any = None) -> Any:
        """The Open Inference Protocol's ServerMetadata RPC."""
        return await self._grpc("ServerMetadata", request, grpc_context)

    async def ModelMetadata(self, request: Any, grpc_context: Any = None) -> Any:
        """The Open Inference Protocol's ModelMetadata RPC."""
        return await self._grpc("ModelMetadata", request, grpc_context)

    async def ModelInfer(self, request: Any, grpc_context: Any = None) -> Any:
        """The Open Inference Protocol's ModelInfer RPC."""
        return await self._grpc("ModelInfer", request, grpc_context)


def _version() -> str:
    from sharedml import __version__

    return __version__


def _replica_identity() -> dict[str, str]:
    """Application, deployment, replica and node of this replica ({} outside Serve)."""
    try:
        import ray
        from ray import serve

        context = serve.get_replica_context()
        return {
            "application": str(context.app_name),
            "deployment": str(context.deployment),
            "replica": str(context.replica_id.unique_id),
            "node_id": str(ray.get_runtime_context().get_node_id()),
        }
    except Exception:  # not inside a Serve replica (a test, or a subclass used directly)
        return {}


def deployment(
    model: str | os.PathLike[str] | bytes,
    *,
    sessions: int | Literal["auto"] | None = None,
    batching: BatchingSetting = "auto",
    providers: Any = None,
    model_name: str | None = None,
    local_copy: bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    pool_options: Mapping[str, Any] | None = None,
    http_limits: HttpLimits | None = None,
    internal_grpc_host: str | None = "node",
    **serve_options: Any,
) -> Any:
    """A Ray Serve application serving ``model``, for ``serve.run``.

    Every replica opens a :class:`~sharedml.SessionPool` over the node's one prepared copy of
    the model (prepared by the first replica of each node into that node's cache); see
    :class:`ModelServer` for the requests it takes.

    Example::

        app = sharedml.ray.deployment("/models/model.onnx", sessions=2, num_replicas=4)
        handle = serve.run(app, route_prefix="/model")

    Args:
        model: Path of any ONNX model, valid on every node, or its bytes.
        sessions: Sessions in each replica's pool (default: the pool's, 4), or ``"auto"``:
            each replica splits its ``num_cpus`` into sessions x threads by measuring.
        batching: ``"auto"`` (default): merge the requests a replica holds wherever the model
            can be batched; True, False or a :class:`~sharedml.Batching`.
        providers: As for ``SessionPool``.
        model_name: The name clients use (default: the model file's stem).
        local_copy: See :func:`sharedml.ray.prepare_on_node`.
        cache_dir: The nodes' cache folder (default: ``$SHAREDML_CACHE_DIR`` on each node).
        pool_options: Any other ``SessionPool`` argument.
        http_limits: What each replica accepts from HTTP bodies: the bytes one request's
            arrays may take, the bytes of all requests a replica holds, the largest JSON body,
            the most rows (default: :class:`HttpLimits`'s defaults, see ``docs/ray.md``).
        internal_grpc_host: Where each replica's internal gRPC server listens: ``"node"``
            (default: the node's address, 127.0.0.1 on a node started on loopback), an address,
            or None for Ray's default (every interface). See
            :func:`sharedml.ray.restrict_replica_grpc`.
        **serve_options: Passed to ``serve.deployment(...).options()``: ``num_replicas``,
            ``max_replicas_per_node``, ``ray_actor_options``, ``autoscaling_config``,
            ``max_ongoing_requests`` (default: see :mod:`sharedml.ray._server`), ``name``...

    Returns:
        The bound application.

    Raises:
        TypeError, ValueError: a pool argument (``sessions``, ``batching``, ``providers``,
            ``pool_options``) that ``SessionPool`` refuses, before any replica starts.
    """
    from ray import serve

    # Checked here, once, before any replica starts: a wrong argument fails this call, not
    # every replica in turn.
    checked = PoolOptions.from_arguments(
        sessions=sessions, batching=batching, providers=providers, **dict(pool_options or {})
    )
    chosen = checked.batching
    rows = chosen.max_batch_size if isinstance(chosen, Batching) else Batching().max_batch_size
    per_session = rows + 1 if chosen is not None else 2
    if sessions == "auto":  # at most a session per CPU the replica holds
        cpus = serve_options.get("ray_actor_options", {}).get("num_cpus") or 1
        count = max(DEFAULT_SESSIONS, math.ceil(cpus))
    else:
        count = sessions or DEFAULT_SESSIONS
    options: dict[str, Any] = {
        "name": f"sharedml-{model_name or _model_name(model)}",
        "max_ongoing_requests": count * per_session,
        **serve_options,
    }
    return (
        serve.deployment(ModelServer)
        .options(**options)
        .bind(
            model if isinstance(model, bytes) else os.fspath(model),
            sessions=sessions,
            batching=batching,
            providers=providers,
            model_name=model_name,
            local_copy=local_copy,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            pool_options=dict(pool_options or {}),
            http_limits=http_limits,
            internal_grpc_host=internal_grpc_host,
        )
    )
