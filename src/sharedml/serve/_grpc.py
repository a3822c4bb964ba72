"""The gRPC side of the Open Inference Protocol: ``inference.GRPCInferenceService``.

:class:`InferenceGrpc` answers the six RPCs over a set of served models. Its methods take a
request message and return the response message, raising what :func:`status_of` maps; the
two hosts only differ in how a failure reaches the client:

- ``sharedml serve`` registers it on a ``grpc.aio`` server (:func:`start_grpc`), where a
  failure aborts the call with its status code;
- :class:`sharedml.ray.ModelServer` calls it from methods named after the RPCs, which Ray
  Serve's gRPC proxy routes to (:func:`add_GRPCInferenceServiceServicer_to_server` is what
  ``grpc_servicer_functions`` names), setting the code on Serve's gRPC context.

Decisions:

- grpcio reads a whole message before any handler runs, so a message is bounded by its size
  (``grpc.max_receive_message_length``: the request limit plus the JSON header's, as over
  HTTP) and the messages in flight by ``maximum_concurrent_rpcs``; once it has arrived, a
  request reserves its bytes and what decoding adds from the same budget as HTTP bodies
  (``RESOURCE_EXHAUSTED`` where the budget is taken).
- Inputs sent as ``raw_input_contents`` get ``raw_output_contents`` back (tritonclient always
  sends raw); typed ``contents`` get typed contents (KServe's client may send either).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from sharedml.protocol import _grpc
from sharedml.protocol._admission import HttpLimits, InflightBytes
from sharedml.protocol._metadata import EXTENSIONS, MODEL_VERSION, PLATFORM
from sharedml.protocol._tensors import RequestError
from sharedml.serve._http import Observer
from sharedml.serve._models import ServedModel
from sharedml.serve._status import GRPC_CODES, status_of

__all__ = [
    "InferenceGrpc",
    "add_GRPCInferenceServiceServicer_to_server",
    "grpc_failure",
    "start_grpc",
]

_MAX_CONCURRENT_RPCS = 1024  # beyond it, grpcio answers RESOURCE_EXHAUSTED itself


def grpc_failure(exc: BaseException) -> tuple[Any, str] | None:
    """(grpc.StatusCode, message) for an exception a call may end with; None: a bug."""
    import grpc

    known = status_of(exc)
    if known is None:
        return None
    status, message, _ = known
    return getattr(grpc.StatusCode, GRPC_CODES.get(status, "INTERNAL")), message


class InferenceGrpc:
    """The six RPCs of ``inference.GRPCInferenceService`` over a set of served models.

    Args:
        models: The served models, by name.
        version: The server's version (ServerMetadata).
        limits: What requests may hold.
        budget: The byte budget shared with HTTP.
        observer: Called once per ModelInfer with the model, ``"grpc"``, the status code's name
            (``"OK"``, ``"INVALID_ARGUMENT"``...) and seconds.

    Thread safety: the methods may be awaited concurrently.
    """

    def __init__(
        self,
        models: Mapping[str, ServedModel],
        *,
        version: str,
        limits: HttpLimits | None = None,
        budget: InflightBytes | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.models = dict(models)
        self.version = version
        self.limits = limits or HttpLimits()
        self.budget = budget or InflightBytes(self.limits.max_inflight_bytes)
        self.observer = observer

    def _model(self, name: str, version: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            served = ", ".join(repr(n) for n in self.models) or "none"
            raise RequestError(404, f"Model {name[:80]!r} is not served here; served: {served}.")
        if version not in ("", MODEL_VERSION):
            raise RequestError(
                404,
                f"Model {name!r} has no version {version[:40]!r}: it has one, "
                f"{MODEL_VERSION!r} (or leave the version out).",
            )
        return model

    async def ServerLive(self, request: Any) -> Any:
        """Whether the server answers."""
        return _grpc.message("ServerLiveResponse")(live=True)

    async def ServerReady(self, request: Any) -> Any:
        """Whether every model takes requests."""
        ready = bool(self.models) and all(m.ready for m in self.models.values())
        return _grpc.message("ServerReadyResponse")(ready=ready)

    async def ModelReady(self, request: Any) -> Any:
        """Whether one model takes requests (false for a model or version not served)."""
        try:
            ready = self._model(request.name, request.version).ready
        except RequestError:
            ready = False
        return _grpc.message("ModelReadyResponse")(ready=ready)

    async def ServerMetadata(self, request: Any) -> Any:
        """The server's name, version and extensions."""
        return _grpc.message("ServerMetadataResponse")(
            name="sharedml", version=self.version, extensions=list(EXTENSIONS)
        )

    async def ModelMetadata(self, request: Any) -> Any:
        """A model's inputs and outputs."""
        model = self._model(request.name, request.version)
        reply = _grpc.message("ModelMetadataResponse")(
            name=model.name, versions=[MODEL_VERSION], platform=PLATFORM
        )
        for infos, field in ((model.inputs, reply.inputs), (model.outputs, reply.outputs)):
            for info in infos.values():
                field.add(name=info.name, datatype=info.datatype or info.type, shape=info.shape)
        return reply

    async def ModelInfer(self, request: Any) -> Any:
        """Run a model on a request's inputs."""
        start = time.perf_counter()
        code = "INTERNAL"
        name = ""
        try:
            model = self._model(request.model_name, request.model_version)
            name = model.name
            reply = await self._infer(model, request)
            code = "OK"
            return reply
        except BaseException as exc:
            known = status_of(exc)
            code = GRPC_CODES.get(known[0], "INTERNAL") if known is not None else "INTERNAL"
            raise
        finally:
            if self.observer is not None and name:
                self.observer(name, "grpc", code, time.perf_counter() - start)

    async def _infer(self, model: ServedModel, request: Any) -> Any:
        size = request.ByteSize()
        reservation = self.budget.reserve(size, "The request")
        try:
            decoded = await asyncio.to_thread(
                _grpc.decode_infer_request, request, model.inputs, self.limits
            )
            reservation.resize(size + decoded.nbytes)
            outputs = await model.infer(decoded.feed, decoded.output_names)
            return await asyncio.to_thread(
                _grpc.encode_infer_response,
                outputs,
                model_name=model.name,
                model_version=MODEL_VERSION,
                request_id=decoded.request_id,
                raw=decoded.raw,
            )
        finally:
            reservation.release()


def _handlers(call: Callable[[str], Callable[[Any, Any], Any]]) -> Any:
    """The service's generic handler, each RPC answered by ``call(method_name)``."""
    import grpc

    methods = {}
    for method, (request, response) in _grpc.METHODS.items():
        methods[method] = grpc.unary_unary_rpc_method_handler(
            call(method),
            request_deserializer=_grpc.message(request).FromString,
            response_serializer=_grpc.message(response).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(_grpc.SERVICE, methods)


def add_GRPCInferenceServiceServicer_to_server(servicer: Any, server: Any) -> None:
    """Register ``inference.GRPCInferenceService`` on ``server``, as generated code would.

    ``servicer`` has one method per RPC taking ``(request, context)``. Named like protoc's
    output so that Ray Serve's ``grpc_servicer_functions`` can point at it
    (``"sharedml.serve._grpc.add_GRPCInferenceServiceServicer_to_server"``): Serve registers
    it with a stand-in servicer and routes each call to the deployment's method of that name.
    """
    server.add_generic_rpc_handlers((_handlers(lambda method: getattr(servicer, method)),))


class _AioServicer:
    """:class:`InferenceGrpc` on a ``grpc.aio`` server: failures abort with their status."""

    def __init__(self, inner: InferenceGrpc) -> None:
        self._inner = inner

    def __getattr__(self, method: str) -> Callable[[Any, Any], Any]:
        rpc = getattr(self._inner, method)

        async def call(request: Any, context: Any) -> Any:
            try:
                return await rpc(request)
            except Exception as exc:
                failure = grpc_failure(exc)
                if failure is None:
                    raise
                await context.abort(*failure)

        return call


async def start_grpc(
    models: Mapping[str, ServedModel],
    address: str,
    *,
    limits: HttpLimits,
    budget: InflightBytes,
    version: str,
    observer: Observer | None = None,
) -> tuple[Any, int]:
    """A started ``grpc.aio`` server answering :class:`InferenceGrpc` at ``address``.

    Returns:
        The server (``await server.stop(grace)`` to drain it) and the port it listens on.

    Raises:
        OSError: the address cannot be bound.
    """
    import grpc

    inner = InferenceGrpc(models, version=version, limits=limits, budget=budget, observer=observer)
    largest = limits.max_request_bytes + limits.max_json_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", largest),
            ("grpc.max_send_message_length", -1),  # replies: what the model makes
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share
        ],
        maximum_concurrent_rpcs=_MAX_CONCURRENT_RPCS,
    )
    add_GRPCInferenceServiceServicer_to_server(_AioServicer(inner), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises RuntimeError for a port it cannot bind
        raise OSError(f"gRPC cannot listen on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"gRPC cannot listen on {address}: the address is in use or not local.")
    await server.start()
    return server, port
