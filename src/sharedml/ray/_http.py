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

- A body is judged before it is decoded. The ``.npy`` header of a body, or of each ``.npz``
  member (read through the first few KiB of the member, whatever the archive says it unpacks
  to), and the ``shape``/``datatype`` of an Open Inference Protocol input say what the arrays
  will be: their names, dtypes, ranks and fixed dimensions are checked against the model's
  inputs (400), their rows and bytes against :class:`HttpLimits` (413), and their bytes are
  reserved from the replica's :class:`InflightBytes` (429 when the requests it holds already
  take its budget) before a byte of array data is inflated or converted. An archive member is
  then read for exactly the bytes its header declares: one that holds more, or whose zip entry
  declares another size, is refused, so a compression bomb inflates a few KiB at most.
- JSON numbers are converted to the model's input dtype only where nothing is lost: integers
  for an integer input (in range), integers or decimals for a float input, ``true``/``false``
  for a bool input, strings for a string input. Anything else is a 400 naming the input, never
  a silent truncation. A declared Open Inference Protocol ``datatype`` must be the model's.
- Missing inputs are left to the pool (``InvalidInputError``, the same message whichever way a
  request arrives); unknown ones are refused here, before their data is decoded.
- Python's ``json`` builds objects of up to :data:`JSON_PARSE_EXPANSION` times a body's size
  while it parses (34x measured, for a body of ``[0],`` repeated): a JSON body reserves that
  much of the replica's budget until it is parsed, then only what its arrays take.
- NaN and infinities in JSON replies are the strings ``"NaN"``, ``"Infinity"`` and
  ``"-Infinity"``: JSON has no literal for them (Python's ``NaN`` token is invalid JSON), and
  these are what JavaScript's ``Number()``, Python's ``float()`` and numpy (so
  ``tritonclient``'s ``as_numpy``) read back as the same values; ``null`` would lose the sign.
- ``.npy``/``.npz`` bodies are read with ``allow_pickle=False``, replies written the same way
  (string outputs as unicode arrays): a body can never run code, and clients need no pickle.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import threading
import zipfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, Literal

import numpy as np

__all__ = [
    "JSON",
    "JSON_PARSE_EXPANSION",
    "NPY",
    "NPZ",
    "HttpError",
    "HttpLimits",
    "InferRequest",
    "InflightBytes",
    "Reservation",
    "TensorInfo",
    "encode_outputs",
    "error_body",
    "max_body_bytes",
    "model_metadata",
    "parse_request",
    "tensor_infos",
]

JSON = "application/json"
NPY = "application/x-npy"
NPZ = "application/x-npz"
# Bytes of Python objects json.loads and np.asarray may build per byte of a JSON body: 34
# measured for "[0],[0],..." (a list per 4 bytes), 10 for "0.5,0.5,...", 2.6 for float32 values
# as clients print them.
JSON_PARSE_EXPANSION = 40
_MAX_NPY_HEADER_BYTES = 10_000  # numpy's own default for a header it reads without pickle
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_BINARY_TYPES = {NPY: "npy", NPZ: "npz", "application/zip": "npz"}
# What np.savez and np.savez_compressed write. Others are refused: LZMA's header chooses the
# dictionary its decoder allocates (up to 4 GiB) before a byte is inflated.
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_MIB = 2**20

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
    """A request the server refuses, with its HTTP status (4xx) and a message for the client.

    Attributes:
        status: The HTTP status.
        message: What is wrong and what to send instead.
        headers: Reply headers (``Retry-After`` for a 429).
    """

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What a replica accepts from HTTP bodies, so that no body, or handful of bodies, exhausts it.

    Attributes:
        max_request_bytes: The most bytes one request's input arrays may take once decoded
            (as their ``.npy`` headers or Open Inference Protocol shapes declare them, counting a
            zero dimension as one); also the largest binary body. Beyond it: 413.
        max_inflight_bytes: The most bytes the HTTP requests a replica holds may take together:
            each request's body, its decoded arrays (an ``.npy`` body's array is the body
            itself), and a JSON body's parse (:data:`JSON_PARSE_EXPANSION` times its size)
            while it lasts. A request beyond it gets 429 with ``Retry-After``.
        max_json_bytes: The largest JSON body. Beyond it: 413 (send ``.npy``/``.npz``).
        max_rows: The most rows (axis 0) an input array may have. Beyond it: 413.
    """

    max_request_bytes: int = 256 * _MIB
    max_inflight_bytes: int = 1024 * _MIB
    max_json_bytes: int = 8 * _MIB
    max_rows: int = 65_536

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"HttpLimits.{field.name} must be a positive integer, not {value!r}."
                )


class Reservation:
    """Bytes a request holds of its replica's :class:`InflightBytes`, until :meth:`release`."""

    def __init__(self, budget: InflightBytes | None, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def resize(self, nbytes: int) -> None:
        """Hold ``nbytes`` instead (a JSON body's arrays once its parse is over).

        Raises:
            HttpError: 429 (or 413) where growing does not fit the budget.
        """
        if self._budget is not None:
            self._budget._resize(self, nbytes)
        else:
            self.nbytes = nbytes

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        self.resize(0)


class InflightBytes:
    """A replica's budget of bytes for the HTTP requests it holds at once. Thread-safe.

    Args:
        limit_bytes: :attr:`HttpLimits.max_inflight_bytes`.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Bytes reserved now."""
        return self._used

    def reserve(self, nbytes: int, what: str = "The request") -> Reservation:
        """Reserve ``nbytes`` for one request.

        Raises:
            HttpError: 413 where ``nbytes`` exceeds the whole budget, 429 where the requests
                in flight leave too little of it.
        """
        reservation = Reservation(self, 0)
        self._resize(reservation, nbytes, what)
        return reservation

    def _resize(self, reservation: Reservation, nbytes: int, what: str = "The request") -> None:
        if nbytes > self.limit_bytes:
            raise HttpError(
                413,
                f"{what} needs {_size(nbytes)} while it is decoded, more than this replica's "
                f"{_size(self.limit_bytes)} for all requests in flight: send smaller requests "
                "(binary .npy/.npz rather than JSON for large tensors).",
            )
        with self._lock:
            grow = nbytes - reservation.nbytes
            if grow > 0 and self._used + grow > self.limit_bytes:
                raise HttpError(
                    429,
                    f"{what} needs {_size(nbytes)} while it is decoded, and the requests this "
                    f"replica holds already take {_size(self._used)} of its "
                    f"{_size(self.limit_bytes)}: retry shortly, or send smaller requests.",
                    {"Retry-After": "1"},
                )
            self._used += grow
            reservation.nbytes = nbytes


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes" if nbytes < _MIB else f"{nbytes / _MIB:.1f} MiB ({nbytes} bytes)"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One model input or output as the HTTP layer describes and converts it.

    Attributes:
        name: The tensor's name.
        type: ORT's type text (``"tensor(float)"``).
        dtype: Its numpy dtype, or None for types JSON cannot carry.
        datatype: Its Open Inference Protocol datatype (``"FP32"``), or None.
        shape: Its dimensions, -1 where dynamic (``()`` also where ORT knows no shape).
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
        reservation: The bytes it holds of the replica's budget: release them once the reply
            is written (None where no budget was given).
    """

    feed: dict[str, np.ndarray]
    output_names: list[str] | None
    style: Style
    request_id: str | None = None
    reservation: Reservation | None = None

    def release(self) -> None:
        """Give the request's bytes back to the replica's budget (idempotent)."""
        if self.reservation is not None:
            self.reservation.release()


def _bad(message: str) -> HttpError:
    return HttpError(400, message)


def _show(value: Any, limit: int = 80) -> str:
    """``value`` as JSON for a message: short, and safe for a value nested thousands deep."""
    try:
        text = json.dumps(value)
    except (RecursionError, TypeError, ValueError):
        text = f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_tensor(
    name: str,
    dtype: np.dtype[Any],
    shape: Sequence[int],
    inputs: Mapping[str, TensorInfo],
    limits: HttpLimits,
) -> int:
    """Check an array described by its dtype and shape, before it exists; return its bytes.

    The dtype, rank and fixed dimensions are judged as the pool judges arrays (the same
    messages); the rows against ``limits``. The bytes count a zero dimension as one, so that
    ``(0, 10**30)`` is as large as it looks.
    """
    info = inputs.get(name)
    if any(d < 0 for d in shape):
        raise _bad(f"Input '{name}' declares shape {list(shape)}: dimensions cannot be negative.")
    if info is not None and info.dtype is not None:
        want = np.dtype(info.dtype)
        strings = want.kind == "O" and dtype.kind in "OUS"
        if dtype != want and not strings:
            raise _bad(f"Input '{name}' must be {info.type} ({want.name}), not {dtype.name}.")
    if info is not None and info.shape:
        model = "[" + ", ".join("?" if d < 0 else str(d) for d in info.shape) + "]"
        if len(shape) != len(info.shape):
            raise _bad(
                f"Input '{name}' must have rank {len(info.shape)} (shape {model}), not "
                f"{len(shape)} (shape {tuple(shape)})."
            )
        for axis, (want_dim, got) in enumerate(zip(info.shape, shape, strict=True)):
            if want_dim >= 0 and want_dim != got:
                raise _bad(
                    f"Input '{name}' must have {want_dim} on axis {axis} (shape {model}), not "
                    f"{got} (shape {tuple(shape)})."
                )
    if shape and shape[0] > limits.max_rows:
        raise HttpError(
            413,
            f"Input '{name}' has {shape[0]} rows, more than this server's {limits.max_rows}: "
            "split the request.",
        )
    return math.prod(max(d, 1) for d in shape) * max(dtype.itemsize, 1)


def _check_request_bytes(nbytes: int, limits: HttpLimits, what: str) -> None:
    if nbytes > limits.max_request_bytes:
        raise HttpError(
            413,
            f"{what} {_size(nbytes)}, more than this server's "
            f"{_size(limits.max_request_bytes)} per request: send smaller requests.",
        )


def _check_names(names: Sequence[str], inputs: Mapping[str, TensorInfo], what: str) -> None:
    """Refuse names the model does not have (their data would be decoded for nothing)."""
    unknown = [n for n in names if n not in inputs]
    if unknown:
        raise _bad(
            f"{what} has unknown input(s) {', '.join(repr(n[:80]) for n in unknown[:8])}; the "
            f"model's inputs are {', '.join(map(repr, inputs))}."
        )


def _array_from_json(value: Any, dtype: Any, what: str) -> np.ndarray:
    """``value`` (nested JSON lists) as an array of ``dtype``, refusing anything lossy."""
    try:
        raw = np.asarray(value)
    except (ValueError, OverflowError, RecursionError) as exc:
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
    except RecursionError:
        raise _bad(
            "The JSON body nests lists or objects too deeply to parse: send each tensor as "
            "nested lists of at most 32 levels, or flat with its shape (Open Inference Protocol)."
        ) from None
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
            raise _bad(f'Each entry of "outputs" must be {shape}, not {_show(item)}.')
        names.append(name)
    return names


def _kserve_header(
    item: Any, inputs: Mapping[str, TensorInfo], limits: HttpLimits
) -> tuple[str, list[int], str, int]:
    """An input's name, shape and datatype, checked before its data is converted; its bytes."""
    if not isinstance(item, dict):
        raise _bad(f'Each entry of "inputs" must be an object, not {_show(item)}.')
    name, shape, datatype = item.get("name"), item.get("shape"), item.get("datatype")
    if not isinstance(name, str):
        raise _bad('An input has no "name" (a string).')
    what = f"Input '{name[:80]}'"
    if "data" not in item:
        raise _bad(f'{what} has no "data".')
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _bad(f'{what}: "shape" must be a list of non-negative integers, not {_show(shape)}.')
    if not isinstance(datatype, str) or datatype not in _DATATYPES:
        shown = repr(datatype[:80]) if isinstance(datatype, str) else _show(datatype)
        raise _bad(f"{what}: datatype {shown} is not one of {', '.join(sorted(_DATATYPES))}.")
    _check_names([name], inputs, "The request")
    model = inputs[name]
    if model.datatype is not None and model.datatype != datatype:
        raise _bad(f"{what} is {model.datatype} in the model; the request sends {datatype}.")
    nbytes = _check_tensor(name, np.dtype(_DATATYPES[datatype]), shape, inputs, limits)
    return name, shape, datatype, nbytes


def _parse_kserve(
    doc: dict[str, Any], inputs: Mapping[str, TensorInfo], limits: HttpLimits
) -> InferRequest:
    items = doc.get("inputs")
    if not isinstance(items, list) or not items:
        raise _bad('"inputs" must be a non-empty list of {"name", "shape", "datatype", "data"}.')
    headers = [_kserve_header(item, inputs, limits) for item in items]
    names = [name for name, *_ in headers]
    for name in names:
        if names.count(name) > 1:
            raise _bad(f"Input '{name[:80]}' is given twice.")
    _check_request_bytes(sum(h[3] for h in headers), limits, "The request's shapes declare")
    feed: dict[str, np.ndarray] = {}
    for item, (name, shape, datatype, _) in zip(items, headers, strict=True):
        what = f"Input '{name}'"
        array = _array_from_json(item["data"], _DATATYPES[datatype], what)
        if array.size != math.prod(shape):
            raise _bad(
                f"{what} has {array.size} values, but its shape {shape} needs {math.prod(shape)}."
            )
        feed[name] = array.reshape(shape)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, (str, int, float)):
        raise _bad(f'"id" must be a string, not {_show(request_id)}.')
    return InferRequest(
        feed,
        _output_names(doc.get("outputs"), kserve=True),
        "kserve",
        str(request_id) if request_id is not None else None,
    )


def _parse_json(
    body: bytes,
    inputs: Mapping[str, TensorInfo],
    limits: HttpLimits,
    budget: InflightBytes | None,
    *,
    kserve: bool,
) -> InferRequest:
    if len(body) > limits.max_json_bytes:
        raise HttpError(
            413,
            f"The JSON body is {_size(len(body))}, more than this server's "
            f"{_size(limits.max_json_bytes)}: send large tensors as .npy/.npz bodies.",
        )
    parse_bytes = len(body) * (1 + JSON_PARSE_EXPANSION)
    reservation = budget.reserve(parse_bytes, "The JSON body") if budget else None
    try:
        request = _json_request(_load_json(body), inputs, limits, kserve=kserve)
        if reservation is not None:  # the parse is over: the body and the arrays remain
            reservation.resize(len(body) + sum(a.nbytes for a in request.feed.values()))
    except BaseException:
        if reservation is not None:
            reservation.release()
        raise
    return dataclasses.replace(request, reservation=reservation)


def _json_request(
    doc: Any, inputs: Mapping[str, TensorInfo], limits: HttpLimits, *, kserve: bool
) -> InferRequest:
    if not isinstance(doc, dict) or "inputs" not in doc:
        raise _bad(
            'The JSON body must be an object with "inputs": a list of {"name", "shape", '
            '"datatype", "data"} (Open Inference Protocol) or an object of nested lists by '
            "input name."
        )
    if kserve or isinstance(doc["inputs"], list):
        return _parse_kserve(doc, inputs, limits)
    if not isinstance(doc["inputs"], dict) or not doc["inputs"]:
        raise _bad('"inputs" must map each input name to its nested list of values.')
    _check_names(list(doc["inputs"]), inputs, "The request")
    feed = {}
    nbytes = 0
    for name, value in doc["inputs"].items():
        info = inputs[name]
        array = _array_from_json(value, info.dtype, f"Input '{name}'")
        nbytes += _check_tensor(name, array.dtype, array.shape, inputs, limits)
        feed[name] = array
    _check_request_bytes(nbytes, limits, "The request's inputs take")
    return InferRequest(feed, _output_names(doc.get("outputs"), kserve=False), "json")


def _npy_header(fp: IO[bytes], what: str) -> tuple[np.dtype[Any], tuple[int, ...], bool]:
    """The dtype, shape and order an ``.npy`` stream's header declares (reads only the header).

    Raises:
        HttpError: 400 for a header numpy cannot read, one of an object array (it would need
            pickle), or a version other than 1.0 and 2.0.
    """
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(
                fp, max_header_size=_MAX_NPY_HEADER_BYTES
            )
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(
                fp, max_header_size=_MAX_NPY_HEADER_BYTES
            )
        else:
            raise _bad(
                f"{what} is not a readable .npy array (format version {version}; np.save "
                "writes 1.0 or 2.0)."
            )
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise _bad(f"{what} is not a readable .npy array ({exc}).") from None
    if dtype.hasobject:
        raise _bad(
            f"{what} holds Python objects, which would need pickle: send numbers, or strings "
            "as a unicode array."
        )
    if dtype.itemsize == 0:
        raise _bad(f"{what} has dtype {dtype.str}, whose items take no bytes.")
    return dtype, tuple(shape), bool(fortran)


def _parse_npy(
    body: bytes,
    inputs: Mapping[str, TensorInfo],
    outputs: list[str] | None,
    limits: HttpLimits,
    budget: InflightBytes | None,
) -> InferRequest:
    if len(inputs) != 1:
        raise _bad(
            f"An .npy body carries one array, but the model has {len(inputs)} inputs "
            f"({', '.join(inputs)}): send an .npz with one array per input name."
        )
    name = next(iter(inputs))
    fp = io.BytesIO(body)
    dtype, shape, fortran = _npy_header(fp, "The .npy body")
    offset = fp.tell()
    nbytes = _check_tensor(name, dtype, shape, inputs, limits)
    _check_request_bytes(nbytes, limits, "The .npy body's header declares")
    count = math.prod(shape)
    if len(body) - offset != count * dtype.itemsize:
        raise _bad(
            f"The .npy body holds {len(body) - offset} bytes of data, but its header declares "
            f"shape {shape} of {dtype.str}, {count * dtype.itemsize} bytes: send the whole "
            "array as np.save writes it."
        )
    reservation = budget.reserve(len(body), "The .npy body") if budget else None
    # The array is the body's own bytes (read-only): nothing is copied.
    flat = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    array = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return InferRequest({name: array}, outputs, "npy", reservation=reservation)


@dataclasses.dataclass(frozen=True)
class _Member:
    info: zipfile.ZipInfo
    name: str
    nbytes: int  # of its array, as its header declares
    bound: int  # the same, a zero dimension counted as one (what the limits judge)


def _open_member(archive: zipfile.ZipFile, member: zipfile.ZipInfo, what: str) -> IO[bytes]:
    try:
        return archive.open(member)
    except (RuntimeError, NotImplementedError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise _bad(f"{what} cannot be read ({exc}).") from None


def _npz_members(
    archive: zipfile.ZipFile, inputs: Mapping[str, TensorInfo], limits: HttpLimits
) -> Iterator[_Member]:
    """Each member's header, checked: reads a few KiB of each, whatever it claims to hold."""
    members = archive.infolist()
    if not members:
        raise _bad("The .npz archive holds no arrays: save one per input name (np.savez).")
    if len(members) > len(inputs):
        raise _bad(
            f"The .npz archive holds {len(members)} members, but the model has "
            f"{len(inputs)} input(s) ({', '.join(inputs)}): one array per input name."
        )
    names: list[str] = []
    for member in members:
        if not member.filename.endswith(".npy"):
            raise _bad(
                f"The .npz archive holds {member.filename[:80]!r}, which is not an .npy array: "
                "save one array per input name (np.savez)."
            )
        name = member.filename[: -len(".npy")]
        what = f"Member '{member.filename[:80]}' of the .npz archive"
        if name in names:
            raise _bad(f"{what} is there twice.")
        names.append(name)
        _check_names([name], inputs, "The .npz archive")
        if member.compress_type not in _ZIP_METHODS:
            raise _bad(
                f"{what} is compressed with method {member.compress_type}: use np.savez or "
                "np.savez_compressed (stored or deflated members)."
            )
        with _open_member(archive, member, what) as fp:
            dtype, shape, _ = _npy_header(fp, what)
            header_bytes = fp.tell()
        bound = _check_tensor(name, dtype, shape, inputs, limits)
        nbytes = math.prod(shape) * dtype.itemsize
        if member.file_size != header_bytes + nbytes:
            raise _bad(
                f"{what} declares {member.file_size} bytes unpacked, but its .npy header "
                f"describes {header_bytes + nbytes} (shape {shape} of {dtype.str}): the archive "
                "is damaged or forged."
            )
        yield _Member(member, name, nbytes, bound)


def _read_member(archive: zipfile.ZipFile, member: _Member) -> np.ndarray:
    """The member's array, inflating no more than its header declares (plus one read)."""
    what = f"Member '{member.info.filename}' of the .npz archive"
    with _open_member(archive, member.info, what) as fp:
        try:
            array = np.lib.format.read_array(
                fp, allow_pickle=False, max_header_size=_MAX_NPY_HEADER_BYTES
            )
            extra = fp.read(1)  # at EOF, zipfile also checks the member's CRC
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise _bad(f"{what} is not a readable .npy array ({exc}).") from None
    if extra:
        raise _bad(f"{what} holds more data than its .npy header declares: it is forged.")
    return np.asarray(array)


def _parse_npz(
    body: bytes,
    inputs: Mapping[str, TensorInfo],
    outputs: list[str] | None,
    limits: HttpLimits,
    budget: InflightBytes | None,
) -> InferRequest:
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _bad(f"The body is not a readable .npz archive ({exc}).") from None
    with archive:
        members = list(_npz_members(archive, inputs, limits))
        _check_request_bytes(sum(m.bound for m in members), limits, "The .npz headers declare")
        nbytes = sum(m.nbytes for m in members)
        reservation = budget.reserve(len(body) + nbytes, "The .npz body") if budget else None
        try:
            feed = {m.name: _read_member(archive, m) for m in members}
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
    return InferRequest(feed, outputs, "npz", reservation=reservation)


def max_body_bytes(content_type: str, limits: HttpLimits) -> int:
    """The longest body of this content type that :func:`parse_request` may accept."""
    media = content_type.split(";")[0].strip().lower()
    if media == JSON or media.endswith("+json"):
        return limits.max_json_bytes
    if media in ("", "application/octet-stream"):  # sniffed: JSON or binary
        return max(limits.max_json_bytes, limits.max_request_bytes)
    return limits.max_request_bytes


def parse_request(
    body: bytes,
    content_type: str,
    inputs: Mapping[str, TensorInfo],
    *,
    kserve: bool = False,
    output_names: list[str] | None = None,
    limits: HttpLimits | None = None,
    budget: InflightBytes | None = None,
) -> InferRequest:
    """Parse an inference request body, judging what it declares before decoding any of it.

    CPU work proportional to the body: call it off the event loop. Thread-safe.

    Args:
        body: The request's bytes.
        content_type: Its ``Content-Type`` header ("" if none).
        inputs: The model's inputs (:func:`tensor_infos`).
        kserve: The request came to an Open Inference Protocol path: its body must have that
            shape.
        output_names: Outputs picked by the query string (``?output=``), for binary bodies.
        limits: What one request may hold (default: :class:`HttpLimits`'s defaults).
        budget: The replica's budget for requests in flight; the request's bytes are reserved
            from it (:attr:`InferRequest.reservation`) until the caller releases them.

    Returns:
        The feed and what the reply should hold.

    Raises:
        HttpError: 400 for a malformed body, lossy values, or arrays whose names, dtypes,
            ranks or fixed dimensions do not fit the model; 413 for a body or arrays beyond
            ``limits``; 415 for a content type that is none of JSON, ``.npy`` and ``.npz``;
            429 where ``budget`` is taken by other requests.
    """
    limits = limits or HttpLimits()
    media = content_type.split(";")[0].strip().lower()
    if media == JSON or media.endswith("+json"):
        return _parse_json(body, inputs, limits, budget, kserve=kserve)
    kind = _BINARY_TYPES.get(media)
    if kind is None and media in ("", "application/octet-stream"):
        if body.startswith(_NPY_MAGIC):
            kind = "npy"
        elif body.startswith(_ZIP_MAGICS):
            kind = "npz"
        elif body.lstrip().startswith(b"{"):
            return _parse_json(body, inputs, limits, budget, kserve=kserve)
    if kind is None:
        raise HttpError(
            415,
            f"Unsupported Content-Type {content_type[:80]!r}: send {JSON}, {NPY} or {NPZ}.",
        )
    if kserve:
        raise _bad(f"Open Inference Protocol requests are JSON, not {kind} bodies.")
    _check_request_bytes(len(body), limits, f"The .{kind} body is")
    if kind == "npy":
        return _parse_npy(body, inputs, output_names, limits, budget)
    return _parse_npz(body, inputs, output_names, limits, budget)


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
    raise HttpError(406, f"Cannot reply with {accept[:80]!r}: accept {JSON}, {NPY} or {NPZ}.")


def _datatype_of(array: np.ndarray) -> str:
    if array.dtype.kind in "OUS":
        return "BYTES"
    for dtype, datatype in _TYPES.values():
        if array.dtype == dtype:
            return datatype
    return array.dtype.name.upper()


def _json_values(array: np.ndarray) -> Any:
    """``array`` as nested lists JSON can carry: non-finite floats as "NaN", "Infinity"..."""
    if array.dtype.kind == "S":
        return np.char.decode(array, "utf-8", errors="replace").tolist()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        values = array.astype(object)
        values[np.isnan(array)] = "NaN"
        values[np.isposinf(array)] = "Infinity"
        values[np.isneginf(array)] = "-Infinity"
        return values.tolist()
    return array.tolist()


def _storable(array: np.ndarray) -> np.ndarray:
    """``array`` as ``.npy`` stores it without pickle: ORT's string outputs as unicode."""
    array = np.asarray(array)
    return array.astype(np.str_) if array.dtype.hasobject else array


def _npz_bytes(outputs: Mapping[str, np.ndarray]) -> bytes:
    """An ``.npz`` archive of ``outputs``, as np.savez writes it (any output name, ``file`` too).

    np.savez takes the arrays as keyword arguments, so an output named ``file`` (its first
    parameter) cannot go through it; the archive is one stored ``<name>.npy`` per output.
    """
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in outputs.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, _storable(array), allow_pickle=False)
    return buf.getvalue()


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
        np.save(buf, _storable(next(iter(outputs.values()))), allow_pickle=False)
        return buf.getvalue(), NPY
    if media == NPZ:
        return _npz_bytes(outputs), NPZ
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
    return json.dumps(doc, allow_nan=False).encode(), JSON


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
