"""Tensors as the wire formats describe them: their dtypes, the model's tensors, the checks.

Every codec (:mod:`._kserve`, :mod:`._numpy`, :mod:`._plain`, :mod:`._grpc`) judges an input
from what a request *declares* (its name, datatype and shape) with the functions here before a
byte of its data is decoded, so that the checks and their messages are the same on every wire
format, and the same as the pool's.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sharedml.model._dtypes import ELEMENT_TYPES

__all__ = [
    "DATATYPES",
    "MIB",
    "TYPES",
    "RequestError",
    "TensorInfo",
    "bad",
    "check_names",
    "check_request_bytes",
    "check_tensor",
    "datatype_of",
    "show",
    "size_text",
    "tensor_infos",
]

MIB = 2**20

# ONNX tensor element types as ORT names them -> (numpy dtype, Open Inference Protocol datatype),
# for the types the wire formats carry: read from the one table, in its order.
TYPES: dict[str, tuple[Any, str]] = {
    t.ort_type: (np.dtype(t.numpy).type, t.datatype)
    for t in ELEMENT_TYPES
    if t.datatype is not None and t.numpy is not None
}
# Open Inference Protocol datatype -> numpy dtype
DATATYPES: dict[str, Any] = {datatype: dtype for dtype, datatype in TYPES.values()}


class RequestError(Exception):
    """A request the server refuses: its HTTP status (4xx) and a message for the client.

    gRPC replies carry the same message with the matching status code
    (:func:`sharedml.protocol.grpc_code`).

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

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray Serve pickles a replica's exception back to its proxy: keep every argument.
        return (type(self), (self.status, self.message, self.headers))


def bad(message: str) -> RequestError:
    """A 400: the request is malformed or does not fit the model."""
    return RequestError(400, message)


def size_text(nbytes: int) -> str:
    """``12.0 MiB (12582912 bytes)``: exact, and readable where it is large."""
    return f"{nbytes} bytes" if nbytes < MIB else f"{nbytes / MIB:.1f} MiB ({nbytes} bytes)"


def show(value: Any, limit: int = 80) -> str:
    """``value`` as JSON for a message: short, and safe for a value nested thousands deep."""
    try:
        text = json.dumps(value)
    except (RecursionError, TypeError, ValueError):
        text = f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One model input or output as the wire formats describe and convert it.

    Attributes:
        name: The tensor's name.
        type: ORT's type text (``"tensor(float)"``).
        dtype: Its numpy dtype, or None for types no wire format here carries.
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
        dtype, datatype = TYPES.get(arg.type, (None, None))
        shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or ()))
        infos[arg.name] = TensorInfo(arg.name, arg.type, dtype, datatype, shape)
    return infos


def datatype_of(array: np.ndarray) -> str:
    """The Open Inference Protocol datatype of an output array (strings are ``BYTES``)."""
    if array.dtype.kind in "OUS":
        return "BYTES"
    for dtype, datatype in TYPES.values():
        if array.dtype == dtype:
            return datatype
    return array.dtype.name.upper()


def check_names(names: Sequence[str], inputs: Mapping[str, TensorInfo], what: str) -> None:
    """Refuse names the model does not have (their data would be decoded for nothing)."""
    unknown = [n for n in names if n not in inputs]
    if unknown:
        raise bad(
            f"{what} has unknown input(s) {', '.join(repr(n[:80]) for n in unknown[:8])}; the "
            f"model's inputs are {', '.join(map(repr, inputs))}."
        )


def check_tensor(
    name: str,
    dtype: np.dtype[Any],
    shape: Sequence[int],
    inputs: Mapping[str, TensorInfo],
    max_rows: int,
) -> int:
    """Check an array described by its dtype and shape, before it exists; return its bytes.

    The dtype, rank and fixed dimensions are judged as the pool judges arrays (the same
    messages); the rows against ``max_rows``. The bytes count a zero dimension as one, so that
    ``(0, 10**30)`` is as large as it looks; strings count one byte each (their real size is
    judged from the bytes that carry them).

    Raises:
        RequestError: 400 for a dtype, rank or dimension the model does not take; 413 for more
            rows than ``max_rows``.
    """
    info = inputs.get(name)
    if any(d < 0 for d in shape):
        raise bad(f"Input '{name}' declares shape {list(shape)}: dimensions cannot be negative.")
    if info is not None and info.dtype is not None:
        want = np.dtype(info.dtype)
        strings = want.kind == "O" and dtype.kind in "OUS"
        if dtype != want and not strings:
            raise bad(f"Input '{name}' must be {info.type} ({want.name}), not {dtype.name}.")
    if info is not None and info.shape:
        model = "[" + ", ".join("?" if d < 0 else str(d) for d in info.shape) + "]"
        if len(shape) != len(info.shape):
            raise bad(
                f"Input '{name}' must have rank {len(info.shape)} (shape {model}), not "
                f"{len(shape)} (shape {tuple(shape)})."
            )
        for axis, (want_dim, got) in enumerate(zip(info.shape, shape, strict=True)):
            if want_dim >= 0 and want_dim != got:
                raise bad(
                    f"Input '{name}' must have {want_dim} on axis {axis} (shape {model}), not "
                    f"{got} (shape {tuple(shape)})."
                )
    if shape and shape[0] > max_rows:
        raise RequestError(
            413,
            f"Input '{name}' has {shape[0]} rows, more than this server's {max_rows}: "
            "split the request.",
        )
    itemsize = 1 if dtype.kind == "O" else max(dtype.itemsize, 1)
    return math.prod(max(d, 1) for d in shape) * itemsize


def check_request_bytes(nbytes: int, max_bytes: int, what: str) -> None:
    """A 413 where one request's arrays (or body) would take more than ``max_bytes``."""
    if nbytes > max_bytes:
        raise RequestError(
            413,
            f"{what} {size_text(nbytes)}, more than this server's {size_text(max_bytes)} per "
            "request: send smaller requests.",
        )
