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
- Bodies are parsed off the replica's event loop (where Serve also runs its health checks), after
  their size and declared arrays are checked against the replica's :class:`HttpLimits`: see
  :mod:`sharedml.ray._http`. A request's bytes stay reserved until its reply is written.
- The replica's internal gRPC server listens on the node's address only (127.0.0.1 on a node
  started on loopback), not on every interface: :func:`sharedml.ray.restrict_replica_grpc`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sharedml._errors import InvalidInputError, PoolClosedError, RunError
from sharedml.pool._batching import Batching
from sharedml.pool._pool import DEFAULT_SESSIONS
from sharedml.ray import _http
from sharedml.ray._http import (
    JSON,
    HttpError,
    HttpLimits,
    InflightBytes,
    encode_outputs,
    error_body,
    max_body_bytes,
    model_metadata,
    tensor_infos,
)
from sharedml.ray._loopback import restrict_replica_grpc
from sharedml.ray._metrics import PoolMetrics
from sharedml.ray._node import BatchingSetting, create_pool, mapped_files

__all__ = ["ModelServer", "deployment"]

_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?(/ready|/infer)?$")
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
    ``.npz`` (see :mod:`sharedml.ray._http`); the Open Inference Protocol's
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
        self.inputs = tensor_infos(self.pool.get_inputs())
        self.outputs = tensor_infos(self.pool.get_outputs())
        self.metrics = PoolMetrics(
            {
                "model": self.model_name,
                "application": self._identity.get("application", ""),
                "deployment": self._identity.get("deployment", ""),
                "replica": self._identity.get("replica", ""),
            }
        )
        self.metrics.record(self.pool.stats())
        _log.info("sharedml: model '%s': %s", self.model_name, self.pool.batching_reason)

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
        start = time.perf_counter()
        names = list(output_names) if output_names is not None else None
        try:
            values = await self.pool.run_async(names, dict(feed))
        finally:
            self.metrics.record(self.pool.stats(), latency_s=time.perf_counter() - start)
        return dict(zip(names or self.outputs, values, strict=True))

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
        from starlette.responses import Response

        headers: dict[str, str] = {}
        try:
            body, media, status = await self._route(request)
        except HttpError as exc:
            body, media, status = error_body(exc.message), JSON, exc.status
            headers = exc.headers
        except InvalidInputError as exc:
            body, media, status = error_body(str(exc)), JSON, 400
        except PoolClosedError as exc:
            body, media, status = error_body(str(exc)), JSON, 503
        except RunError as exc:
            body, media, status = error_body(str(exc)), JSON, 500
        return Response(body, status_code=status, media_type=media, headers=headers)

    async def _route(self, request: Any) -> tuple[bytes, str, int]:
        root = request.scope.get("root_path", "")
        path = request.scope.get("path", "")
        relative = (path[len(root) :] if path.startswith(root) else path).rstrip("/")
        method = request.method
        if relative == "":
            _allow(method, "POST")
            return await self._infer_http(request, kserve=False)
        if relative in ("/v2/health/live", "/v2/health/ready"):
            _allow(method, "GET")
            return b"{}", JSON, 200
        match = _MODEL_PATH.match(relative)
        if match is None:
            raise HttpError(
                404,
                f"No route {relative!r}: POST / or /v2/models/{self.model_name}/infer.",
            )
        if match.group(1) != self.model_name:
            raise HttpError(
                404,
                f"Model {match.group(1)!r} is not served here; this deployment serves "
                f"{self.model_name!r}.",
            )
        suffix = match.group(2)
        if suffix == "/infer":
            _allow(method, "POST")
            return await self._infer_http(request, kserve=True)
        _allow(method, "GET")
        if suffix == "/ready":
            return b"{}", JSON, 200
        metadata = model_metadata(self.model_name, self.inputs, self.outputs)
        return json.dumps(metadata).encode(), JSON, 200

    async def _infer_http(self, request: Any, *, kserve: bool) -> tuple[bytes, str, int]:
        content_type = request.headers.get("content-type", "")
        body = await _read_body(request, max_body_bytes(content_type, self.http_limits))
        # Parsing is CPU work proportional to the body: off the event loop, where Serve runs
        # health checks and every other request of the replica.
        parsed = await asyncio.to_thread(
            _http.parse_request,
            body,
            content_type,
            self.inputs,
            kserve=kserve,
            output_names=request.query_params.getlist("output") or None,
            limits=self.http_limits,
            budget=self.inflight,
        )
        del body  # the request holds what it needs (an .npy body: its array)
        try:
            outputs = await self.infer(parsed.feed, parsed.output_names)
            # Encoding a large reply is CPU work too.
            reply, media = await asyncio.to_thread(
                encode_outputs,
                outputs,
                parsed,
                accept=request.headers.get("accept", ""),
                model_name=self.model_name,
            )
        finally:
            parsed.release()
        return reply, media, 200


async def _read_body(request: Any, max_bytes: int) -> bytes:
    """The request's body, refused (413) as soon as it is longer than ``max_bytes``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise HttpError(413, _too_long(int(declared), max_bytes))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HttpError(413, _too_long(size, max_bytes))
        chunks.append(chunk)
    return b"".join(chunks)


def _too_long(size: int, max_bytes: int) -> str:
    return (
        f"The body has {size} bytes or more, and this server takes at most {max_bytes}: send "
        "smaller requests (HttpLimits.max_request_bytes and max_json_bytes)."
    )


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise HttpError(405, f"Use {allowed} here, not {method}.")


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
    """
    from ray import serve

    rows = batching.max_batch_size if isinstance(batching, Batching) else Batching().max_batch_size
    per_session = rows + 1 if batching is not False else 2
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
