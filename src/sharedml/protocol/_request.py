"""One HTTP request body to a feed, and outputs to a reply: picks the codec by what was sent.

Four request shapes reach a model over HTTP:

- **Open Inference Protocol** (KServe v2, Triton's HTTP API) at ``/v2/models/<name>/infer``:
  JSON, or JSON plus binary tensor data where ``Inference-Header-Content-Length`` is sent
  (:mod:`._kserve`). Its JSON form is also taken at a server's root.
- **Plain JSON** at the root: ``{"inputs": {"<name>": nested lists}}`` (:mod:`._json`).
- **Binary** at the root: an ``.npy`` body for a model with one input, an ``.npz`` body with one
  array per input name (:mod:`._numpy`); outputs come back as ``.npy`` (one output) or
  ``.npz``, or as JSON where the ``Accept`` header asks for it.

``?output=<name>`` (repeatable) picks outputs for every shape; a body that names outputs too
must name the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from sharedml.protocol import _json, _kserve, _numpy
from sharedml.protocol._admission import JSON_PARSE_EXPANSION, HttpLimits, Reservation
from sharedml.protocol._tensors import RequestError, TensorInfo, bad, size_text

__all__ = [
    "JSON",
    "OCTET_STREAM",
    "InferRequest",
    "Reply",
    "encode_outputs",
    "max_body_bytes",
    "parse_request",
]

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
_BINARY_TYPES = {_numpy.NPY: "npy", _numpy.NPZ: "npz", "application/zip": "npz"}

Style = Literal["kserve", "json", "npy", "npz"]


@dataclasses.dataclass(frozen=True)
class InferRequest:
    """A parsed inference request.

    Attributes:
        feed: Input arrays by name.
        output_names: The outputs asked for (None: all).
        style: The request's shape, which picks the reply's by default.
        reservation: The bytes it holds of the server's budget: release them once the reply
            is written.
        kserve: The Open Inference Protocol request (its id and binary choices), for that style.
    """

    feed: dict[str, np.ndarray]
    output_names: list[str] | None
    style: Style
    reservation: Reservation
    kserve: _kserve.KServeRequest | None = None

    @property
    def request_id(self) -> str | None:
        """The Open Inference Protocol ``id``, echoed in the reply."""
        return self.kserve.request_id if self.kserve is not None else None

    def release(self) -> None:
        """Give the request's bytes back to the server's budget (idempotent)."""
        self.reservation.release()


@dataclasses.dataclass(frozen=True)
class Reply:
    """A reply body (in parts, written in order), its media type and extra headers."""

    parts: Sequence[bytes | memoryview]
    media: str
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def body(self) -> bytes:
        """The parts joined (one copy)."""
        return b"".join(self.parts)


def _media(content_type: str) -> str:
    return content_type.split(";")[0].strip().lower()


def max_body_bytes(content_type: str, limits: HttpLimits, *, binary_header: bool) -> int:
    """The longest body of this content type that :func:`parse_request` may accept."""
    media = _media(content_type)
    if binary_header:
        return limits.max_json_bytes + limits.max_request_bytes
    if media == JSON or media.endswith("+json"):
        return limits.max_json_bytes
    if media in ("", OCTET_STREAM):  # sniffed: JSON or binary
        return max(limits.max_json_bytes, limits.max_request_bytes)
    return limits.max_request_bytes


def _header_length(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit():
        raise bad(
            f"{_kserve.BINARY_HEADER} must be the JSON part's length in bytes, not {value[:40]!r}."
        )
    return int(value)


def _merge_outputs(body: list[str] | None, query: list[str] | None) -> list[str] | None:
    if query is None:
        return body
    if body is not None and body != query:
        raise bad(
            f"The body asks for outputs {body} and ?output= for {query}: name them in one place."
        )
    return query


def parse_request(
    body: bytes | bytearray,
    content_type: str,
    inputs: Mapping[str, TensorInfo],
    *,
    reservation: Reservation,
    kserve: bool = False,
    header_length: str | None = None,
    output_names: list[str] | None = None,
    limits: HttpLimits | None = None,
) -> InferRequest:
    """Parse an inference request body, judging what it declares before decoding any of it.

    CPU work proportional to the body: call it off the event loop. Thread-safe.

    Args:
        body: The request's bytes.
        content_type: Its ``Content-Type`` header ("" if none).
        inputs: The model's inputs (:func:`tensor_infos`).
        reservation: The request's bytes of the server's budget (holding the body, from
            :func:`read_body`): resized while decoding, handed to the request on success and
            released on failure.
        kserve: The request came to an Open Inference Protocol path: its body must have that
            shape.
        header_length: The ``Inference-Header-Content-Length`` header, where sent.
        output_names: Outputs picked by the query string (``?output=``).
        limits: What one request may hold (default: :class:`HttpLimits`'s defaults).

    Returns:
        The feed and what the reply should hold.

    Raises:
        RequestError: 400 for a malformed body, lossy values, or arrays whose names, dtypes,
            ranks or fixed dimensions do not fit the model; 413 for a body or arrays beyond
            ``limits``; 415 for a content type that is none of JSON, ``.npy`` and ``.npz``;
            429 where the budget is taken by other requests.
    """
    limits = limits or HttpLimits()
    try:
        return _parse(
            body, content_type, inputs, reservation, kserve, header_length, output_names, limits
        )
    except BaseException:
        reservation.release()
        raise


def _parse(
    body: bytes | bytearray,
    content_type: str,
    inputs: Mapping[str, TensorInfo],
    reservation: Reservation,
    kserve: bool,
    header: str | None,
    query_outputs: list[str] | None,
    limits: HttpLimits,
) -> InferRequest:
    media = _media(content_type)
    length = _header_length(header)
    if length is not None:
        return _open_inference(body, length, inputs, reservation, query_outputs, limits)
    kind = _BINARY_TYPES.get(media)
    is_json = media == JSON or media.endswith("+json")
    if kind is None and not is_json and media in ("", OCTET_STREAM):
        if body.startswith(_numpy.NPY_MAGIC):
            kind = "npy"
        elif body.startswith(_numpy.ZIP_MAGICS):
            kind = "npz"
        elif body.lstrip().startswith(b"{"):
            is_json = True
    if is_json:
        if kserve:
            return _open_inference(body, None, inputs, reservation, query_outputs, limits)
        return _json_request(body, inputs, reservation, query_outputs, limits)
    if kind is None:
        raise RequestError(
            415,
            f"Unsupported Content-Type {content_type[:80]!r}: send {JSON}, {_numpy.NPY} or "
            f"{_numpy.NPZ} (or binary tensors with {_kserve.BINARY_HEADER}).",
        )
    if kserve:
        raise bad(
            f"Open Inference Protocol requests are JSON (with binary tensors after it where "
            f"{_kserve.BINARY_HEADER} says), not {kind} bodies."
        )
    if len(body) > limits.max_request_bytes:
        raise RequestError(
            413,
            f"The .{kind} body is {size_text(len(body))}, more than this server's "
            f"{size_text(limits.max_request_bytes)} per request: send smaller requests.",
        )
    parse = _numpy.parse_npy if kind == "npy" else _numpy.parse_npz
    feed = parse(
        body,
        inputs,
        max_rows=limits.max_rows,
        max_bytes=limits.max_request_bytes,
        reservation=reservation,
    )
    return InferRequest(feed, query_outputs, "npy" if kind == "npy" else "npz", reservation)


def _open_inference(
    body: bytes | bytearray,
    header_length: int | None,
    inputs: Mapping[str, TensorInfo],
    reservation: Reservation,
    query_outputs: list[str] | None,
    limits: HttpLimits,
    doc: object = None,
) -> InferRequest:
    parsed = _kserve.parse_kserve(
        body, header_length, inputs, limits=limits, reservation=reservation, doc=doc
    )
    names = _merge_outputs(parsed.output_names, query_outputs)
    return InferRequest(parsed.feed, names, "kserve", reservation, parsed)


def _json_request(
    body: bytes | bytearray,
    inputs: Mapping[str, TensorInfo],
    reservation: Reservation,
    query_outputs: list[str] | None,
    limits: HttpLimits,
) -> InferRequest:
    if len(body) > limits.max_json_bytes:
        raise RequestError(
            413,
            f"The JSON body is {size_text(len(body))}, more than this server's "
            f"{size_text(limits.max_json_bytes)}: send large tensors as binary data.",
        )
    reservation.resize(len(body) * (1 + JSON_PARSE_EXPANSION), "The JSON body")
    doc = _json.load_json(body)
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise bad(
            'The JSON body must be an object with "inputs": a list of {"name", "shape", '
            '"datatype", "data"} (Open Inference Protocol) or an object of nested lists by '
            "input name."
        )
    if isinstance(doc["inputs"], list):
        return _open_inference(body, None, inputs, reservation, query_outputs, limits, doc)
    feed, names = _json.parse_plain(
        doc, inputs, max_rows=limits.max_rows, max_bytes=limits.max_request_bytes
    )
    del doc
    reservation.resize(len(body) + sum(a.nbytes for a in feed.values()))
    return InferRequest(feed, _merge_outputs(names, query_outputs), "json", reservation)


def _reply_media(accept: str, style: Style) -> str:
    """The reply's format: the first of JSON, .npy, .npz that ``accept`` names."""
    default = {"kserve": JSON, "json": JSON, "npy": _numpy.NPY, "npz": _numpy.NPZ}[style]
    wanted = [_media(part) for part in accept.split(",") if part.strip()]
    if not wanted:
        return default
    for media in wanted:
        if media in (JSON, _numpy.NPY, _numpy.NPZ):
            return media
        if media in ("*/*", "application/*", OCTET_STREAM):
            return default
    raise RequestError(
        406, f"Cannot reply with {accept[:80]!r}: accept {JSON}, {_numpy.NPY} or {_numpy.NPZ}."
    )


def encode_outputs(
    outputs: Mapping[str, np.ndarray],
    request: InferRequest,
    *,
    accept: str,
    model_name: str,
) -> Reply:
    """The reply for ``outputs`` of ``request``.

    Raises:
        RequestError: 406 where ``accept`` names no format this server writes, or asks for one
            ``.npy`` array while there are several outputs.
    """
    media = _reply_media(accept, request.style)
    if media == _numpy.NPY:
        return Reply([_numpy.npy_reply(outputs)], _numpy.NPY)
    if media == _numpy.NPZ:
        return Reply([_numpy.npz_reply(outputs)], _numpy.NPZ)
    if request.style != "kserve":
        return Reply([_json.plain_reply(outputs, model_name)], JSON)
    kserve = request.kserve or _kserve.KServeRequest({}, None, None)
    parts, header_length = _kserve.kserve_reply(outputs, kserve, model_name)
    if header_length is None:
        return Reply(parts, JSON)
    return Reply(parts, OCTET_STREAM, {_kserve.BINARY_HEADER: str(header_length)})
