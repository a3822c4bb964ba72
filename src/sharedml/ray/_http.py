"""HTTP bodies to feeds and outputs to bodies: JSON, ``.npy``/``.npz``, Open Inference Protocol.

Pure functions over bytes and numpy arrays (no web framework, no Ray), so every rule here is
tested without a server. Three request shapes reach a model:

- **Open Inference Protocol** (KServe v2, also Triton's HTTP API): ``{"inputs": [{"name",
  "shape", "datatype", "data"}], "outputs": [{"name"}]}`` at ``/v2/models/<name>/infer`` (or
  at the deployment's root). The reply is ``{"model_name", "id", "outputs": [{"name", "shape",
  "datatype", "data"}]}`` with ``data`` flattened in row-major order; an error is
  ``{"error": "<message>"}``, as the protocol specifies.
- **Plain JSON**: ``{"inputs": {"<name>": nested lists}, "outputs": ["<name>"]}`` gives
  ``{"model_name", "outputs": {"<name>": nested lists}}``.
- **Binary**, for large tensors: an ``.npy`` body for a model with one input, an ``.npz`` body
  with one array per input name; outputs come back as ``.npy`` (one output) or ``.npz``, or as
  JSON where the ``Accept`` header asks for it; ``?output=<name>`` picks outputs.

Decisions:

- JSON numbers are converted to the model's input dtype only where nothing is lost: integers
  for an integer input (in range), integers or decimals for a float input, ``true``/``false``
  for a bool input, strings for a string input. Anything else is a 400 naming the input, never
  a silent truncation. A declared Open Inference Protocol ``datatype`` must be the model's.
- Names, ranks and fixed dimensions are left to the pool (``InvalidInputError``), so a request
  is judged by the same rules whichever way it arrives.
- ``np.load`` runs with ``allow_pickle=False``: a body can never run code.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

__all__ = [
    "DEFAULT_MAX_NPZ_BYTES",
    "JSON",
    "NPY",
    "NPZ",
    "HttpError",
    "InferRequest",
    "TensorInfo",
    "encode_outputs",
    "error_body",
    "model_metadata",
    "parse_request",
    "tensor_infos",
]

JSON = "application/json"
NPY = "application/x-npy"
NPZ = "application/x-npz"
DEFAULT_MAX_NPZ_BYTES = 1 << 30  # bytes an .npz body may unpack to
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_BINARY_TYPES = {NPY: "npy", NPZ: "npz", "application/zip": "npz"}

# ONNX tensor element types as ORT names them -> (numpy dtype, Open Inference Protocol datatype)
_TYPES: dict[str, tuple[Any, str]] = {
    "tensor(float)": (np.float32, "FP32"),
    "tensor(double)": (np.float64, "FP64"),
    "tensor(float16)": (np.float16, "FP16"),
    "tensor(int8)": (np.int8, "INT8"),
    "tensor(int16)": (np.int16, "INT16"),
    "tensor(int32)": (np.int32, "INT32"),
    "tensor(int64)": (np.int64, "INT64"),
    "tensor(uint8)": (np.uint8, "UINT8"),
    "tensor(uint16)": (np.uint16, "UINT16"),
    "tensor(uint32)": (np.uint32, "UINT32"),
    "tensor(uint64)": (np.uint64, "UINT64"),
    "tensor(bool)": (np.bool_, "BOOL"),
    "tensor(string)": (np.object_, "BYTES"),
}
_DATATYPES = {datatype: dtype for dtype, datatype in _TYPES.values()}

Style = Literal["kserve", "json", "npy", "npz"]


class HttpError(Exception):
    """A request the server refuses, with its HTTP status (4xx) and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One model input or output as the HTTP layer describes and converts it.

    Attributes:
        name: The tensor's name.
        type: ORT's type text (``"tensor(float)"``).
        dtype: Its numpy dtype, or None for types JSON cannot carry.
        datatype: Its Open Inference Protocol datatype (``"FP32"``), or None.
        shape: Its dimensions, -1 where dynamic.
    """

    name: str
    type: str
    dtype: Any
    datatype: str | None
    shape: tuple[int, ...]


def tensor_infos(node_args: Sequence[Any]) -> dict[str, TensorInfo]:
    """``pool.get_inputs()`` (or outputs) as :class:`TensorInfo`, by name, in order."""
    infos: dict[str, TensorInfo] = {}
    for arg in node_args:
        dtype, datatype = _TYPES.get(arg.type, (None, None))
        shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or ()))
        infos[arg.name] = TensorInfo(arg.name, arg.type, dtype, datatype, shape)
    return infos


@dataclasses.dataclass(frozen=True)
class InferRequest:
    """A parsed inference request.

    Attributes:
        feed: Input arrays by name.
        output_names: The outputs asked for (None: all).
        style: The request's shape, which picks the reply's by default.
        request_id: The Open Inference Protocol ``id``, echoed in the reply.
    """

    feed: dict[str, np.ndarray]
    output_names: list[str] | None
    style: Style
    request_id: str | None = None


def _bad(message: str) -> HttpError:
    return HttpError(400, message)


def _array_from_json(value: Any, dtype: Any, what: str) -> np.ndarray:
    """``value`` (nested JSON lists) as an array of ``dtype``, refusing anything lossy."""
    try:
        raw = np.asarray(value)
    except (ValueError, OverflowError) as exc:
        raise _bad(f"{what} is not a rectangular array of numbers ({exc}).") from None
    if dtype is None:
        return raw
    target = np.dtype(dtype)
    if raw.size == 0:
        return raw.astype(target)
    kind = raw.dtype.kind
    allowed = {"f": "iuf", "i": "iu", "u": "iu", "b": "b", "O": "U"}.get(target.kind, "")
    if kind not in allowed:
        wanted = {"f": "numbers", "i": "integers", "u": "integers", "b": "true/false"}
        raise _bad(
            f"{what} must hold {wanted.get(target.kind, 'strings')} for the model's "
            f"{target.name if target.kind != 'O' else 'string'} input; it holds "
            f"{_json_kind(raw)}."
        )
    if target.kind in "iu":
        info = np.iinfo(target)
        low, high = int(raw.min()), int(raw.max())
        if low < info.min or high > info.max:
            raise _bad(
                f"{what} holds {low if low < info.min else high}, outside the range of the "
                f"model's {target.name} input ({info.min} to {info.max})."
            )
    if target.kind == "O":
        return raw.astype(object)
    try:
        with np.errstate(over="raise", invalid="raise"):
            return raw.astype(target)
    except FloatingPointError:
        too_large = f"{what} holds a number too large for the model's {target.name} input."
        raise _bad(too_large) from None


def _json_kind(raw: np.ndarray) -> str:
    return {
        "f": "decimal numbers",
        "i": "integers",
        "u": "integers",
        "b": "true/false",
        "U": "strings",
    }.get(raw.dtype.kind, "values of mixed types, nulls or integers beyond 64 bits")


def _load_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(f"The body is not valid JSON ({exc}).") from None


def _output_names(value: Any, *, kserve: bool) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad('"outputs" must be a list.')
    names = []
    for item in value:
        name = (item.get("name") if isinstance(item, dict) else None) if kserve else item
        if not isinstance(name, str):
            shape = '{"name": "<output>"}' if kserve else '"<output>"'
            raise _bad(f'Each entry of "outputs" must be {shape}, not {json.dumps(item)}.')
        names.append(name)
    return names


def _kserve_input(item: Any, inputs: Mapping[str, TensorInfo]) -> tuple[str, np.ndarray]:
    if not isinstance(item, dict):
        raise _bad(f'Each entry of "inputs" must be an object, not {json.dumps(item)}.')
    name, shape, datatype = item.get("name"), item.get("shape"), item.get("datatype")
    if not isinstance(name, str):
        raise _bad('An input has no "name" (a string).')
    what = f"Input '{name}'"
    if "data" not in item:
        raise _bad(f'{what} has no "data".')
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _bad(f'{what}: "shape" must be a list of non-negative integers, not {shape!r}.')
    if datatype not in _DATATYPES:
        raise _bad(f"{what}: datatype {datatype!r} is not one of {', '.join(sorted(_DATATYPES))}.")
    model = inputs.get(name)
    if model is not None and model.datatype is not None and model.datatype != datatype:
        raise _bad(f"{what} is {model.datatype} in the model; the request sends {datatype}.")
    array = _array_from_json(item["data"], _DATATYPES[datatype], what)
    if array.size != math.prod(shape):
        raise _bad(
            f"{what} has {array.size} values, but its shape {shape} needs {math.prod(shape)}."
        )
    return name, array.reshape(shape)


def _parse_kserve(doc: dict[str, Any], inputs: Mapping[str, TensorInfo]) -> InferRequest:
    items = doc.get("inputs")
    if not isinstance(items, list) or not items:
        raise _bad('"inputs" must be a non-empty list of {"name", "shape", "datatype", "data"}.')
    feed: dict[str, np.ndarray] = {}
    for item in items:
        name, array = _kserve_input(item, inputs)
        if name in feed:
            raise _bad(f"Input '{name}' is given twice.")
        feed[name] = array
    request_id = doc.get("id")
    return InferRequest(
        feed,
        _output_names(doc.get("outputs"), kserve=True),
        "kserve",
        str(request_id) if request_id is not None else None,
    )


def _parse_json(body: bytes, inputs: Mapping[str, TensorInfo], *, kserve: bool) -> InferRequest:
    doc = _load_json(body)
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise _bad(
            'The JSON body must be an object with "inputs": a list of {"name", "shape", '
            '"datatype", "data"} (Open Inference Protocol) or an object of nested lists by '
            "input name."
        )
    if kserve or isinstance(doc["inputs"], list):
        return _parse_kserve(doc, inputs)
    if not isinstance(doc["inputs"], dict) or not doc["inputs"]:
        raise _bad('"inputs" must map each input name to its nested list of values.')
    feed = {}
    for name, value in doc["inputs"].items():
        info = inputs.get(name)
        feed[name] = _array_from_json(value, info.dtype if info else None, f"Input '{name}'")
    return InferRequest(feed, _output_names(doc.get("outputs"), kserve=False), "json")


def _parse_npy(
    body: bytes, inputs: Mapping[str, TensorInfo], outputs: list[str] | None
) -> InferRequest:
    if len(inputs) != 1:
        raise _bad(
            f"An .npy body carries one array, but the model has {len(inputs)} inputs "
            f"({', '.join(inputs)}): send an .npz with one array per input name."
        )
    try:
        array = np.load(io.BytesIO(body), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise _bad(f"The body is not a readable .npy array ({exc}).") from None
    return InferRequest({next(iter(inputs)): array}, outputs, "npy")


def _parse_npz(body: bytes, outputs: list[str] | None, max_bytes: int) -> InferRequest:
    try:
        with zipfile.ZipFile(io.BytesIO(body)) as archive:
            unpacked = sum(member.file_size for member in archive.infolist())
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise _bad(f"The body is not a readable .npz archive ({exc}).") from None
    if unpacked > max_bytes:
        raise HttpError(
            413,
            f"The .npz archive unpacks to {unpacked} bytes, more than this server's "
            f"{max_bytes}: send smaller requests.",
        )
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as archive:
            feed = {name: archive[name] for name in archive.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise _bad(f"The body is not a readable .npz archive ({exc}).") from None
    if not feed:
        raise _bad("The .npz archive holds no arrays: save one per input name (np.savez).")
    return InferRequest(feed, outputs, "npz")


def parse_request(
    body: bytes,
    content_type: str,
    inputs: Mapping[str, TensorInfo],
    *,
    kserve: bool = False,
    output_names: list[str] | None = None,
    max_npz_bytes: int = DEFAULT_MAX_NPZ_BYTES,
) -> InferRequest:
    """Parse an inference request body.

    Args:
        body: The request's bytes.
        content_type: Its ``Content-Type`` header ("" if none).
        inputs: The model's inputs (:func:`tensor_infos`).
        kserve: The request came to an Open Inference Protocol path: its body must have that
            shape.
        output_names: Outputs picked by the query string (``?output=``), for binary bodies.
        max_npz_bytes: The most bytes an ``.npz`` body may unpack to (a compressed archive
            can unpack to far more than its size).

    Returns:
        The feed and what the reply should hold.

    Raises:
        HttpError: 400 for a malformed body or lossy values, 413 for an ``.npz`` that
            unpacks to more than ``max_npz_bytes``, 415 for a content type that is none of
            JSON, ``.npy`` and ``.npz``.
    """
    media = content_type.split(";")[0].strip().lower()
    if media == JSON or media.endswith("+json"):
        return _parse_json(body, inputs, kserve=kserve)
    kind = _BINARY_TYPES.get(media)
    if kind is None and media in ("", "application/octet-stream"):
        if body.startswith(_NPY_MAGIC):
            kind = "npy"
        elif body.startswith(_ZIP_MAGICS):
            kind = "npz"
        elif body.lstrip().startswith(b"{"):
            return _parse_json(body, inputs, kserve=kserve)
    if kind is None:
        raise HttpError(
            415,
            f"Unsupported Content-Type {content_type!r}: send {JSON}, {NPY} or {NPZ}.",
        )
    if kserve:
        raise _bad(f"Open Inference Protocol requests are JSON, not {kind} bodies.")
    if kind == "npy":
        return _parse_npy(body, inputs, output_names)
    return _parse_npz(body, output_names, max_npz_bytes)


def _reply_media(accept: str, style: Style) -> str:
    """The reply's media type: the first of JSON, .npy, .npz that ``accept`` names."""
    default = {"kserve": JSON, "json": JSON, "npy": NPY, "npz": NPZ}[style]
    wanted = [part.split(";")[0].strip().lower() for part in accept.split(",") if part.strip()]
    if not wanted:
        return default
    for media in wanted:
        if media in (JSON, NPY, NPZ):
            return media
        if media in ("*/*", "application/*"):
            return default
    raise HttpError(406, f"Cannot reply with {accept!r}: accept {JSON}, {NPY} or {NPZ}.")


def _datatype_of(array: np.ndarray) -> str:
    if array.dtype.kind in "OUS":
        return "BYTES"
    for dtype, datatype in _TYPES.values():
        if array.dtype == dtype:
            return datatype
    return array.dtype.name.upper()


def _json_values(array: np.ndarray) -> Any:
    if array.dtype.kind == "S":
        return np.char.decode(array, "utf-8", errors="replace").tolist()
    return array.tolist()


def encode_outputs(
    outputs: Mapping[str, np.ndarray],
    request: InferRequest,
    *,
    accept: str,
    model_name: str,
) -> tuple[bytes, str]:
    """The reply body and its media type for ``outputs`` of ``request``.

    Raises:
        HttpError: 406 where ``accept`` names no format this server writes, or asks for one
            ``.npy`` array while there are several outputs.
    """
    media = _reply_media(accept, request.style)
    if media == NPY:
        if len(outputs) != 1:
            raise HttpError(
                406,
                f"An .npy reply holds one array, but {len(outputs)} outputs were asked for "
                f"({', '.join(outputs)}): pick one with ?output=<name>, or accept {NPZ}.",
            )
        buf = io.BytesIO()
        np.save(buf, next(iter(outputs.values())), allow_pickle=False)
        return buf.getvalue(), NPY
    if media == NPZ:
        buf = io.BytesIO()
        np.savez(buf, **dict(outputs))  # type: ignore[arg-type]
        return buf.getvalue(), NPZ
    doc: dict[str, Any] = {"model_name": model_name}
    if request.style == "kserve":
        if request.request_id is not None:
            doc["id"] = request.request_id
        doc["outputs"] = [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _datatype_of(array),
                "data": _json_values(array.reshape(-1)),
            }
            for name, array in outputs.items()
        ]
    else:
        doc["outputs"] = {name: _json_values(array) for name, array in outputs.items()}
    return json.dumps(doc).encode(), JSON


def error_body(message: str) -> bytes:
    """An error reply: ``{"error": message}`` (the Open Inference Protocol's error shape)."""
    return json.dumps({"error": message}).encode()


def model_metadata(
    name: str, inputs: Mapping[str, TensorInfo], outputs: Mapping[str, TensorInfo]
) -> dict[str, Any]:
    """The Open Inference Protocol's model metadata (``GET /v2/models/<name>``)."""

    def describe(infos: Mapping[str, TensorInfo]) -> list[dict[str, Any]]:
        return [
            {"name": i.name, "datatype": i.datatype or i.type, "shape": list(i.shape)}
            for i in infos.values()
        ]

    return {
        "name": name,
        "versions": [],
        "platform": "onnxruntime_onnx",
        "inputs": describe(inputs),
        "outputs": describe(outputs),
    }
