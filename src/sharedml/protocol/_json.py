"""JSON values to arrays and back, losslessly; and sharedml's plain JSON requests.

Plain JSON: ``{"inputs": {"<name>": nested lists}, "outputs": ["<name>"]}``, whose reply is
``{"model_name", "outputs": {"<name>": nested lists}}``.

Decisions:

- JSON numbers are converted to the model's input dtype only where nothing is lost: integers
  for an integer input (in range), integers or decimals for a float input, ``true``/``false``
  for a bool input, strings for a string input. Anything else is a 400 naming the input, never
  a silent truncation.
- NaN and infinities in JSON replies are the strings ``"NaN"``, ``"Infinity"`` and
  ``"-Infinity"``: JSON has no literal for them (Python's ``NaN`` token is invalid JSON), and
  these are what JavaScript's ``Number()``, Python's ``float()`` and numpy (so
  ``tritonclient``'s ``as_numpy``) read back as the same values; ``null`` would lose the sign.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from sharedml.protocol._tensors import (
    TensorInfo,
    bad,
    check_names,
    check_request_bytes,
    check_tensor,
    show,
)

__all__ = [
    "array_from_json",
    "dump_json",
    "json_values",
    "load_json",
    "output_names",
    "parse_plain",
    "plain_reply",
]


def load_json(body: bytes | bytearray | memoryview, what: str = "The body") -> Any:
    """Parse JSON, as a 400 where it is not (or nests too deeply to parse)."""
    try:
        return json.loads(bytes(body) if isinstance(body, memoryview) else body)
    except RecursionError:
        raise bad(
            f"{what} nests lists or objects too deeply to parse: send each tensor as "
            "nested lists of at most 32 levels, or flat with its shape (Open Inference Protocol)."
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"{what} is not valid JSON ({exc}).") from None


def dump_json(doc: Any) -> bytes:
    """A reply document as strict JSON bytes (no NaN tokens: see :func:`json_values`)."""
    return json.dumps(doc, allow_nan=False).encode()


def _json_kind(raw: np.ndarray) -> str:
    return {
        "f": "decimal numbers",
        "i": "integers",
        "u": "integers",
        "b": "true/false",
        "U": "strings",
    }.get(raw.dtype.kind, "values of mixed types, nulls or integers beyond 64 bits")


def array_from_json(value: Any, dtype: Any, what: str) -> np.ndarray:
    """``value`` (nested JSON lists) as an array of ``dtype``, refusing anything lossy."""
    try:
        raw = np.asarray(value)
    except (ValueError, OverflowError, RecursionError) as exc:
        raise bad(f"{what} is not a rectangular array of numbers ({exc}).") from None
    if dtype is None:
        return raw
    target = np.dtype(dtype)
    if raw.size == 0:
        return raw.astype(target)
    kind = raw.dtype.kind
    allowed = {"f": "iuf", "i": "iu", "u": "iu", "b": "b", "O": "U"}.get(target.kind, "")
    if kind not in allowed:
        wanted = {"f": "numbers", "i": "integers", "u": "integers", "b": "true/false"}
        raise bad(
            f"{what} must hold {wanted.get(target.kind, 'strings')} for the model's "
            f"{target.name if target.kind != 'O' else 'string'} input; it holds "
            f"{_json_kind(raw)}."
        )
    if target.kind in "iu":
        info = np.iinfo(target)
        low, high = int(raw.min()), int(raw.max())
        if low < info.min or high > info.max:
            raise bad(
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
        raise bad(too_large) from None


def json_values(array: np.ndarray) -> Any:
    """``array`` as nested lists JSON can carry: non-finite floats as "NaN", "Infinity"..."""
    if array.dtype.kind == "S":
        return np.char.decode(array, "utf-8", errors="replace").tolist()
    if array.dtype.kind == "O" and array.size:
        return np.asarray(_text(array)).tolist()
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        values = array.astype(object)
        values[np.isnan(array)] = "NaN"
        values[np.isposinf(array)] = "Infinity"
        values[np.isneginf(array)] = "-Infinity"
        return values.tolist()
    return array.tolist()


def _decode(value: Any) -> Any:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


_text = np.frompyfunc(_decode, 1, 1)  # an object array's bytes items as str, the rest as is


def output_names(value: Any, *, kserve: bool) -> list[str] | None:
    """The ``outputs`` a request asks for (None: all), checked for shape."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad('"outputs" must be a list.')
    names = []
    for item in value:
        name = (item.get("name") if isinstance(item, dict) else None) if kserve else item
        if not isinstance(name, str):
            shape = '{"name": "<output>"}' if kserve else '"<output>"'
            raise bad(f'Each entry of "outputs" must be {shape}, not {show(item)}.')
        names.append(name)
    return names


def parse_plain(
    doc: Mapping[str, Any], inputs: Mapping[str, TensorInfo], *, max_rows: int, max_bytes: int
) -> tuple[dict[str, np.ndarray], list[str] | None]:
    """A plain JSON request (``{"inputs": {name: nested lists}}``): its feed and outputs."""
    if not isinstance(doc["inputs"], dict) or not doc["inputs"]:
        raise bad('"inputs" must map each input name to its nested list of values.')
    check_names(list(doc["inputs"]), inputs, "The request")
    feed = {}
    nbytes = 0
    for name, value in doc["inputs"].items():
        info = inputs[name]
        array = array_from_json(value, info.dtype, f"Input '{name}'")
        nbytes += check_tensor(name, array.dtype, array.shape, inputs, max_rows)
        feed[name] = array
    check_request_bytes(nbytes, max_bytes, "The request's inputs take")
    return feed, output_names(doc.get("outputs"), kserve=False)


def plain_reply(outputs: Mapping[str, np.ndarray], model_name: str) -> bytes:
    """The plain JSON reply: ``{"model_name", "outputs": {name: nested lists}}``."""
    doc = {
        "model_name": model_name,
        "outputs": {name: json_values(array) for name, array in outputs.items()},
    }
    return dump_json(doc)
