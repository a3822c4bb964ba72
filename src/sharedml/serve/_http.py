"""The HTTP side of the Open Inference Protocol (and sharedml's plain forms), for any ASGI host.

:class:`InferenceHttp` is both an ASGI application (what ``sharedml serve`` hands to uvicorn)
and a handler of one starlette request (what :class:`sharedml.ray.ModelServer` calls inside a
Ray Serve replica), so both servers answer every request with the same code, codecs and
limits.

Routes, relative to the application's root:

- ``GET /v2``: server metadata; ``GET /v2/health/live``, ``GET /v2/health/ready``.
- ``GET /v2/models/<name>[/versions/<v>]``: model metadata; ``.../ready``: readiness.
- ``POST /v2/models/<name>[/versions/<v>]/infer``: inference (JSON, or JSON plus binary
  tensors: :mod:`sharedml.protocol._kserve`).
- ``POST /``: inference on the only model, with any body :mod:`sharedml.protocol._request`
  takes (plain JSON, ``.npy``, ``.npz``, Open Inference Protocol JSON).
- Extra ``GET`` routes the host adds (``/metrics`` in ``sharedml serve``).

Decisions:

- A request body is admitted before it is read (:func:`sharedml.protocol.read_body`): its
  ``Content-Length`` is reserved from the server's budget, or refused (413, 429), before a byte
  of it is read; a chunked body is reserved as it arrives and refused past the limit; a body
  that stops arriving gets a 408.
- Bodies are parsed, and replies encoded, in a worker thread: the event loop (where Ray Serve
  also runs its health checks) never waits on a large body.
- Errors are ``{"error": "<message>"}`` (the protocol's error shape) with the status of
  :func:`sharedml.serve._status.status_of`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from sharedml.protocol._admission import HttpLimits, InflightBytes, read_body
from sharedml.protocol._kserve import BINARY_HEADER
from sharedml.protocol._metadata import MODEL_VERSION, server_metadata
from sharedml.protocol._request import JSON, encode_outputs, max_body_bytes, parse_request
from sharedml.protocol._tensors import RequestError
from sharedml.serve._models import ServedModel
from sharedml.serve._status import status_of

_T = TypeVar("_T")

__all__ = ["InferenceHttp", "Observer", "error_body"]

_MODEL_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer)?$")

# (model name or "", protocol "http"/"grpc", status code as text, seconds): per request.
Observer = Callable[[str, str, str, float], None]


def error_body(message: str) -> bytes:
    """An error reply: ``{"error": message}`` (the Open Inference Protocol's error shape)."""
    return json.dumps({"error": message}).encode()


def _allow(method: str, allowed: str) -> None:
    if method != allowed and not (allowed == "GET" and method == "HEAD"):
        raise RequestError(405, f"Use {allowed} here, not {method}.")


def _json(doc: Any, status: int = 200) -> tuple[int, bytes, str, dict[str, str]]:
    return status, json.dumps(doc).encode(), JSON, {}


# Bodies and outputs up to this size are decoded and encoded on the event loop itself: handing
# such work to a thread costs more than the work (two thread switches a step), bytes.
_INLINE_BYTES = 64 * 1024


async def _off_loop_if(off: bool, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``, in a worker thread where ``off``, else here."""
    if off:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


_WATCH_DISCONNECT = "sharedml.watch_disconnect"  # scope key: this request's hang-up is watched


async def _unless_disconnected(request: Any, work: Coroutine[Any, Any, _T]) -> _T:
    """``work``'s result, or ``ClientDisconnect`` once the client hangs up (``work`` cancelled).

    A request whose client left while it waited for a session (or in a batch that has not run
    yet) is cancelled: it never runs, and its batch serves the others (``run_async``).
    """
    task = asyncio.ensure_future(work)
    if not request.scope.get(_WATCH_DISCONNECT):
        return await task

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        from starlette.requests import ClientDisconnect

        raise ClientDisconnect()
    return task.result()


class InferenceHttp:
    """Open Inference Protocol routes over a set of served models: an ASGI app and a handler.

    Args:
        models: The served models, by name.
        version: The server's version (server metadata).
        limits: What requests may hold (default: :class:`HttpLimits`'s defaults).
        budget: The server's byte budget for requests in flight (default: one of
            ``limits.max_inflight_bytes``); share it with the gRPC side.
        observer: Called once per request with the model, ``"http"``, the status and seconds.
        extra_routes: More ``GET`` routes: path -> a function returning (body, media type).
    """

    def __init__(
        self,
        models: Mapping[str, ServedModel],
        *,
        version: str,
        limits: HttpLimits | None = None,
        budget: InflightBytes | None = None,
        observer: Observer | None = None,
        extra_routes: Mapping[str, Callable[[], tuple[bytes, str]]] | None = None,
    ) -> None:
        self.models = dict(models)
        self.version = version
        self.limits = limits or HttpLimits()
        self.budget = budget or InflightBytes(self.limits.max_inflight_bytes)
        self.observer = observer
        self.extra_routes = dict(extra_routes or {})

    # ----------------------------------------------------------------------------------------
    # ASGI

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI application (HTTP; lifespan events are acknowledged)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":  # websockets: nothing here speaks them
            return
        from starlette.requests import Request

        # Served by this app's own server (uvicorn): once the body is read, the next message
        # is the client's hang-up, which cancels its inference (Ray Serve cancels a request
        # whose client left itself, so its handler does not watch).
        scope[_WATCH_DISCONNECT] = True
        response = await self.handle(Request(scope, receive))
        await response(scope, receive, send)

    # ----------------------------------------------------------------------------------------
    # One request

    async def handle(self, request: Any) -> Any:
        """Answer one starlette request; paths are relative to its ``root_path``."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response

        start = time.perf_counter()
        status = 500
        seen: list[str] = []  # the model the request is for, once its path names one
        try:
            status, body, media, headers = await self._route(request, seen)
        except ClientDisconnect:
            status, body, media, headers = 499, b"", JSON, {}  # nobody is left to read it
        except Exception as exc:
            known = status_of(exc)
            if known is None:
                raise
            status, message, headers = known
            body, media = error_body(message), JSON
        finally:
            if self.observer is not None and seen:
                self.observer(seen[0], "http", str(status), time.perf_counter() - start)
        return Response(body, status_code=status, media_type=media, headers=headers)

    def _model(self, name: str, version: str | None) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            served = ", ".join(repr(n) for n in self.models) or "none"
            raise RequestError(404, f"Model {name[:80]!r} is not served here; served: {served}.")
        if version not in (None, "", MODEL_VERSION):
            raise RequestError(
                404,
                f"Model {name!r} has no version {version[:40]!r}: it has one, "
                f"{MODEL_VERSION!r} (or leave the version out).",
            )
        return model

    async def _route(self, request: Any, seen: list[str]) -> tuple[int, bytes, str, dict[str, str]]:
        root = request.scope.get("root_path", "")
        path = request.scope.get("path", "")
        relative = (path[len(root) :] if root and path.startswith(root) else path).rstrip("/")
        method = request.method
        if relative == "":
            _allow(method, "POST")
            if len(self.models) != 1:
                raise RequestError(
                    404,
                    f"This server serves {len(self.models)} models: POST to "
                    "/v2/models/<name>/infer.",
                )
            model = next(iter(self.models.values()))
            seen.append(model.name)
            return await self._infer(model, request, kserve=False)
        if relative in self.extra_routes:
            _allow(method, "GET")
            body, media = self.extra_routes[relative]()
            return 200, body, media, {}
        if relative == "/v2":
            _allow(method, "GET")
            return _json(server_metadata(self.version))
        if relative == "/v2/health/live":
            _allow(method, "GET")
            return _json({"live": True})
        if relative == "/v2/health/ready":
            _allow(method, "GET")
            ready = bool(self.models) and all(m.ready for m in self.models.values())
            return _json({"ready": ready}, 200 if ready else 503)
        match = _MODEL_PATH.match(relative)
        if match is None:
            raise RequestError(
                404,
                f"No route {relative[:80]!r}: POST /v2/models/<name>/infer, GET /v2/models/<name>"
                ", /v2/health/live, /v2/health/ready, /v2.",
            )
        model = self._model(match.group(1), match.group(2))
        suffix = match.group(3)
        if suffix == "/infer":
            _allow(method, "POST")
            seen.append(model.name)
            return await self._infer(model, request, kserve=True)
        _allow(method, "GET")
        if suffix == "/ready":
            return _json({"name": model.name, "ready": model.ready}, 200 if model.ready else 503)
        return _json(model.metadata())

    async def _infer(
        self, model: ServedModel, request: Any, *, kserve: bool
    ) -> tuple[int, bytes, str, dict[str, str]]:
        headers = request.headers
        content_type = headers.get("content-type", "")
        header_length = headers.get(BINARY_HEADER.lower())
        if headers.get("content-encoding", "identity").lower() not in ("", "identity"):
            raise RequestError(
                415,
                f"Content-Encoding {headers['content-encoding'][:40]!r} is not accepted: send "
                "the body uncompressed.",
            )
        length = headers.get("content-length")
        declared = int(length) if length is not None and length.strip().isdigit() else None
        body, reservation = await read_body(
            request.stream(),
            declared=declared,
            max_bytes=max_body_bytes(
                content_type, self.limits, binary_header=header_length is not None
            ),
            budget=self.budget,
            timeout_s=self.limits.body_timeout_s,
        )
        # Parsing is CPU work proportional to the body: off the event loop, where the server
        # answers every other request (and Ray Serve its health checks), where the body is
        # large enough for that to matter.
        parsed = await _off_loop_if(
            len(body) > _INLINE_BYTES,
            parse_request,
            body,
            content_type,
            model.inputs,
            reservation=reservation,
            kserve=kserve,
            header_length=header_length,
            output_names=request.query_params.getlist("output") or None,
            limits=self.limits,
        )
        del body  # the request holds what it needs (an .npy body: its array)
        try:
            outputs = await _unless_disconnected(
                request, model.infer(parsed.feed, parsed.output_names)
            )
            # Encoding a large reply is CPU work too.
            large = any(getattr(v, "dtype", None) == "O" for v in outputs.values()) or (
                sum(getattr(v, "nbytes", 0) for v in outputs.values()) > _INLINE_BYTES
            )
            reply = await _off_loop_if(
                large,
                encode_outputs,
                outputs,
                parsed,
                accept=headers.get("accept", ""),
                model_name=model.name,
            )
            body_out = await _off_loop_if(large, reply.body)
            return 200, body_out, reply.media, dict(reply.headers)
        finally:
            parsed.release()
