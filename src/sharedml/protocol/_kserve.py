"""The Open Inference Protocol's REST form (KServe v2, Triton's HTTP API): JSON and binary.

A request is a JSON document ``{"id", "parameters", "inputs": [{"name", "shape", "datatype",
"parameters", "data"}], "outputs": [{"name", "parameters"}]}``, optionally followed by binary
tensor data (the **binary tensor extension**): the ``Inference-Header-Content-Length`` header
then says how many bytes of the body are JSON, and each input whose ``parameters`` hold
``binary_data_size`` takes that many bytes of what follows, in the order of ``inputs``
(row-major, little-endian; ``BYTES`` elements each prefixed by their length as 4 bytes,
little-endian). Outputs come back in binary where the request asks (``binary_data`` on an
output, or ``binary_data_output`` for all), with ``binary_data_size`` in their ``parameters``;
JSON ``data`` otherwise.

Decisions:

- Every input's ``shape`` and ``datatype`` are judged before its data is converted, and the
  binary sizes the JSON declares must add up to exactly the bytes after the header: a lying
  size, a header length past the body or a truncated body is a 400 naming what disagrees.
- Binary data becomes arrays without a copy where it is aligned for its dtype (one aligned
  copy otherwise); ``BOOL`` bytes must be 0 or 1, ``BYTES`` elements valid UTF-8.
- ``parameters`` that change what a reply means and that sharedml does not implement
  (``sequence_id`` and friends: stateful models; ``classification``: Triton's top-k) are a 400
  rather than ignored; others (``priority``, ``timeout``, custom ones) are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from sharedml.protocol._admission import JSON_PARSE_EXPANSION, HttpLimits, Reservation
from sharedml.protocol._json import array_from_json, dump_json, json_values, load_json
from sharedml.protocol._tensors import (
    DATATYPES,
    RequestError,
    TensorInfo,
    bad,
    check_names,
    check_request_bytes,
    check_tensor,
    datatype_of,
    show,
    size_text,
)

__all__ = [
    "BINARY_HEADER",
    "KServeRequest",
    "decode_bytes_tensor",
    "encode_bytes_tensor",
    "kserve_reply",
    "parse_kserve",
]

BINARY_HEADER = "Inference-Header-Content-Length"
# Request parameters whose meaning sharedml cannot honour: refused, never silently ignored.
_UNSUPPORTED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


@dataclasses.dataclass(frozen=True)
class KServeRequest:
    """A parsed Open Inference Protocol request.

    Attributes:
        feed: Input arrays by name.
        output_names: The outputs asked for (None: all).
        request_id: The request's ``id``, echoed in the reply.
        binary_outputs: Output name -> whether to send it as binary data (outputs the request
            names); ``binary_default`` for the others.
        binary_default: The request's ``binary_data_output``.
    """

    feed: dict[str, np.ndarray]
    output_names: list[str] | None
    request_id: str | None = None
    binary_outputs: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    binary_default: bool = False

    def binary(self, name: str) -> bool:
        """Whether output ``name`` goes back as binary data."""
        return self.binary_outputs.get(name, self.binary_default)


def _parameters(item: Mapping[str, Any], what: str) -> dict[str, Any]:
    value = item.get("parameters", {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f'{what}: "parameters" must be an object, not {show(value)}.')
    return value


def _flag(parameters: Mapping[str, Any], key: str, what: str, default: bool) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise bad(f'{what}: parameter "{key}" must be true or false, not {show(value)}.')
    return value


@dataclasses.dataclass(frozen=True)
class _Declared:
    name: str
    shape: list[int]
    datatype: str
    nbytes: int  # as the shape declares it (a zero dimension counted as one)
    binary_size: int | None  # bytes of the binary section, or None: JSON "data"


def _declared(item: Any, inputs: Mapping[str, TensorInfo], limits: HttpLimits) -> _Declared:
    """An input's name, shape, datatype and binary size, checked before its data is touched."""
    if not isinstance(item, dict):
        raise bad(f'Each entry of "inputs" must be an object, not {show(item)}.')
    name, shape, datatype = item.get("name"), item.get("shape"), item.get("datatype")
    if not isinstance(name, str):
        raise bad('An input has no "name" (a string).')
    what = f"Input '{name[:80]}'"
    if "data" not in item and "binary_data_size" not in _parameters(item, what):
        raise bad(f'{what} has no "data" (nor "binary_data_size" in its "parameters").')
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(f'{what}: "shape" must be a list of non-negative integers, not {show(shape)}.')
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        shown = repr(datatype[:80]) if isinstance(datatype, str) else show(datatype)
        raise bad(f"{what}: datatype {shown} is not one of {', '.join(sorted(DATATYPES))}.")
    check_names([name], inputs, "The request")
    model = inputs[name]
    if model.datatype is not None and model.datatype != datatype:
        raise bad(f"{what} is {model.datatype} in the model; the request sends {datatype}.")
    nbytes = check_tensor(name, np.dtype(DATATYPES[datatype]), shape, inputs, limits.max_rows)
    size = _parameters(item, what).get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise bad(
                f'{what}: "binary_data_size" must be a non-negative integer, not {show(size)}.'
            )
        if "data" in item:
            raise bad(f'{what} has both "data" and "binary_data_size": send one of them.')
        itemsize = np.dtype(DATATYPES[datatype]).itemsize
        if datatype != "BYTES" and size != math.prod(shape) * itemsize:
            raise bad(
                f"{what} declares {size} bytes of binary data, but its shape {shape} of "
                f"{datatype} takes {math.prod(shape) * itemsize}."
            )
    elif "data" not in item:
        raise bad(f'{what} has no "data" (nor "binary_data_size" in its "parameters").')
    return _Declared(name, shape, datatype, nbytes, size)


def decode_bytes_tensor(data: memoryview, count: int, what: str) -> np.ndarray:
    """``count`` length-prefixed UTF-8 elements (the wire form of ``BYTES``) as str objects."""
    values: list[str] = []
    pos = 0
    for _ in range(count):
        if pos + 4 > len(data):
            raise bad(f"{what} ends inside the length of element {len(values)} of {count}.")
        length = int.from_bytes(data[pos : pos + 4], "little")
        pos += 4
        if pos + length > len(data):
            raise bad(
                f"{what}: element {len(values)} declares {length} bytes, but only "
                f"{len(data) - pos} remain."
            )
        try:
            values.append(str(data[pos : pos + length], "utf-8"))
        except UnicodeDecodeError as exc:
            raise bad(f"{what}: element {len(values)} is not valid UTF-8 ({exc}).") from None
        pos += length
    if pos != len(data):
        raise bad(
            f"{what} holds {len(data) - pos} bytes after its {count} elements: the shape and "
            "the binary data disagree."
        )
    array = np.empty(count, dtype=object)
    array[:] = values
    return array


def encode_bytes_tensor(array: np.ndarray) -> bytes:
    """Strings (or bytes) as the wire form of ``BYTES``: each prefixed by its length."""
    parts = []
    for value in array.reshape(-1).tolist():
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
        parts.append(len(raw).to_bytes(4, "little"))
        parts.append(raw)
    return b"".join(parts)


def _from_binary(data: memoryview, declared: _Declared, what: str) -> tuple[np.ndarray, int]:
    """The input's array from its binary section; the bytes it adds to the body's (copies)."""
    count = math.prod(declared.shape)
    if declared.datatype == "BYTES":
        array = decode_bytes_tensor(data, count, what)
        return array.reshape(declared.shape), len(data) + 8 * count
    dtype = np.dtype(DATATYPES[declared.datatype]).newbyteorder("<")
    array = np.frombuffer(data, dtype=dtype, count=count)
    added = 0
    if not array.dtype.isnative or not array.flags.aligned:
        array = array.astype(dtype.newbyteorder("="))
        added = array.nbytes
    if declared.datatype == "BOOL":
        raw = array.view(np.uint8)
        if raw.size and raw.max() > 1:
            raise bad(f"{what} holds BOOL bytes other than 0 and 1.")
    return array.reshape(declared.shape), added


def parse_kserve(
    body: bytes | bytearray,
    header_length: int | None,
    inputs: Mapping[str, TensorInfo],
    *,
    limits: HttpLimits,
    reservation: Reservation,
    doc: Any = None,
) -> KServeRequest:
    """An Open Inference Protocol request: JSON, or JSON plus binary tensor data.

    Args:
        body: The whole body.
        header_length: ``Inference-Header-Content-Length`` (None: the body is all JSON).
        inputs: The model's inputs.
        limits: What one request may hold.
        reservation: The request's bytes (holding the body): grown while the JSON is parsed,
            then set to the body plus what decoding added.
        doc: The JSON part, where the caller has parsed it already (a JSON body).

    Raises:
        RequestError: 400 for a malformed request or one that does not fit the model, 413
            beyond ``limits``, 429 where the budget cannot hold its parse.
    """
    if header_length is not None:
        if header_length > len(body):
            raise bad(
                f"{BINARY_HEADER} is {header_length}, past the end of the {len(body)}-byte body: "
                "it must be the length of the JSON part."
            )
        if header_length > limits.max_json_bytes:
            raise RequestError(
                413,
                f"The JSON header is {size_text(header_length)}, more than this server's "
                f"{size_text(limits.max_json_bytes)}: send tensors as binary data.",
            )
    elif len(body) > limits.max_json_bytes:
        raise RequestError(
            413,
            f"The JSON body is {size_text(len(body))}, more than this server's "
            f"{size_text(limits.max_json_bytes)}: send large tensors as binary data "
            f"({BINARY_HEADER}).",
        )
    view = memoryview(body)
    split = len(body) if header_length is None else header_length
    header, binary = view[:split], view[split:]
    if doc is None:
        reservation.resize(len(body) + len(header) * JSON_PARSE_EXPANSION, "The JSON header")
        doc = load_json(header, "The JSON body" if header_length is None else "The JSON header")
    if not isinstance(doc, dict):
        raise bad(
            'The request must be a JSON object with "inputs": a list of {"name", "shape", '
            '"datatype", "data"}.'
        )
    items = doc.get("inputs")
    if not isinstance(items, list) or not items:
        raise bad('"inputs" must be a non-empty list of {"name", "shape", "datatype", "data"}.')
    request_parameters = _parameters(doc, "The request")
    for key in _UNSUPPORTED_PARAMETERS:
        if request_parameters.get(key) not in (None, 0, "", False):
            raise bad(
                f'The request sets parameter "{key}": sequences (stateful models) are not '
                "supported by this server."
            )
    declared = [_declared(item, inputs, limits) for item in items]
    names = [d.name for d in declared]
    for name in names:
        if names.count(name) > 1:
            raise bad(f"Input '{name[:80]}' is given twice.")
    check_request_bytes(
        sum(d.nbytes for d in declared), limits.max_request_bytes, "The request's shapes declare"
    )
    binary_total = sum(d.binary_size or 0 for d in declared)
    if binary_total != len(binary):
        if header_length is None:
            raise bad(
                f'Inputs declare {binary_total} bytes of binary data ("binary_data_size") but the '
                f"request has no {BINARY_HEADER} header: send it with the JSON part's length."
            )
        raise bad(
            f'The inputs\' "binary_data_size" add up to {binary_total} bytes, but the body holds '
            f"{len(binary)} bytes after its {header_length}-byte JSON header: the sizes or the "
            "header length are wrong, or the body was cut short."
        )
    feed: dict[str, np.ndarray] = {}
    offset = 0
    added = 0
    for item, d in zip(items, declared, strict=True):
        what = f"Input '{d.name}'"
        if d.binary_size is not None:
            array, extra = _from_binary(binary[offset : offset + d.binary_size], d, what)
            offset += d.binary_size
        else:
            array = array_from_json(item["data"], DATATYPES[d.datatype], what)
            extra = array.nbytes if array.dtype.kind != "O" else 8 * array.size
            if array.size != math.prod(d.shape):
                raise bad(
                    f"{what} has {array.size} values, but its shape {d.shape} needs "
                    f"{math.prod(d.shape)}."
                )
            array = array.reshape(d.shape)
        added += extra
        feed[d.name] = array
    del header, binary, view  # the arrays keep what they need of the body
    reservation.resize(len(body) + added)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, (str, int, float)):
        raise bad(f'"id" must be a string, not {show(request_id)}.')
    binary_default = _flag(request_parameters, "binary_data_output", "The request", False)
    outputs = doc.get("outputs")
    output_names: list[str] | None = None
    binary_outputs: dict[str, bool] = {}
    if outputs is not None:
        if not isinstance(outputs, list):
            raise bad('"outputs" must be a list of {"name"}.')
        output_names = []
        for spec in outputs:
            wanted = spec.get("name") if isinstance(spec, dict) else None
            if not isinstance(wanted, str):
                raise bad(
                    f'Each entry of "outputs" must be {{"name": "<output>"}}, not {show(spec)}.'
                )
            what = f"Output '{wanted[:80]}'"
            parameters = _parameters(spec, what)
            if parameters.get("classification") not in (None, 0):
                raise bad(
                    f'{what} asks for "classification" (top-k classes), which this server does '
                    "not compute: ask for the output and take the top k yourself."
                )
            binary_outputs[wanted] = _flag(parameters, "binary_data", what, binary_default)
            output_names.append(wanted)
    return KServeRequest(
        feed,
        output_names,
        str(request_id) if request_id is not None else None,
        binary_outputs,
        binary_default,
    )


def kserve_reply(
    outputs: Mapping[str, np.ndarray],
    request: KServeRequest,
    model_name: str,
    model_version: str = "1",
) -> tuple[Sequence[bytes | memoryview], int | None]:
    """The reply's parts (JSON, then binary sections) and its JSON length where binary follows.

    Returns:
        The body's parts, to be joined or written in order, and the value of
        ``Inference-Header-Content-Length`` (None: the reply is all JSON).
    """
    described = []
    sections: list[bytes | memoryview] = []
    for name, value in outputs.items():
        array = np.asarray(value)
        item: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(array),
            "shape": list(array.shape),
        }
        if request.binary(name):
            if item["datatype"] == "BYTES":
                raw: bytes | memoryview = encode_bytes_tensor(array)
            else:
                little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
                raw = memoryview(cast(Any, little)).cast("B")
            item["parameters"] = {"binary_data_size": len(raw)}
            sections.append(raw)
        else:
            item["data"] = json_values(array.reshape(-1))
        described.append(item)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.request_id is not None:
        doc["id"] = request.request_id
    doc["outputs"] = described
    header = dump_json(doc)
    return [header, *sections], (len(header) if sections else None)
