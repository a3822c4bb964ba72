"""The Open Inference Protocol's binary tensor extension: JSON header plus raw tensor bytes.

Requests are built here as the protocol describes them (tritonclient and KServe's client build
the same bytes: ``tests/serve/test_clients.py`` runs them unchanged against a server).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from sharedml.protocol import _kserve, _request, _tensors
from sharedml.protocol._admission import HttpLimits, InflightBytes, Reservation
from sharedml.protocol._tensors import RequestError


class _Arg:
    def __init__(self, name: str, type_: str, shape: list[Any]) -> None:
        self.name, self.type, self.shape = name, type_, shape


INPUTS = _tensors.tensor_infos(
    [
        _Arg("x", "tensor(float)", ["batch", 3]),
        _Arg("ids", "tensor(int64)", ["batch"]),
        _Arg("text", "tensor(string)", ["batch"]),
        _Arg("mask", "tensor(bool)", ["batch"]),
        _Arg("half", "tensor(float16)", ["batch"]),
    ]
)
HEADER = _kserve.BINARY_HEADER


def strings(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def binary_request(
    tensors: list[tuple[str, str, list[int], bytes | None, Any]],
    *,
    outputs: list[dict[str, Any]] | None = None,
    parameters: dict[str, Any] | None = None,
    **extra: Any,
) -> tuple[bytes, int]:
    """(body, header length) for ``(name, datatype, shape, binary bytes or None, JSON data)``."""
    doc: dict[str, Any] = {"inputs": [], **extra}
    blobs = []
    for name, datatype, shape, raw, data in tensors:
        item: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if raw is not None:
            item["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            item["data"] = data
        doc["inputs"].append(item)
    if outputs is not None:
        doc["outputs"] = outputs
    if parameters is not None:
        doc["parameters"] = parameters
    header = json.dumps(doc).encode()
    return header + b"".join(blobs), len(header)


def parse(
    body: bytes,
    header_length: int | str | None,
    *,
    budget: InflightBytes | None = None,
    limits: HttpLimits | None = None,
    content_type: str = "",
) -> _request.InferRequest:
    held = budget.reserve(len(body)) if budget else Reservation(None, len(body))
    return _request.parse_request(
        body,
        content_type,
        INPUTS,
        reservation=held,
        kserve=True,
        header_length=None if header_length is None else str(header_length),
        limits=limits,
    )


def refused(status: int, body: bytes, header_length: Any, **kw: Any) -> str:
    with pytest.raises(RequestError) as info:
        parse(body, header_length, **kw)
    assert info.value.status == status, info.value.message
    return info.value.message


X = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_every_datatype_arrives_as_the_model_dtype_without_a_copy_where_aligned() -> None:
    body, length = binary_request(
        [
            ("x", "FP32", [2, 3], X.tobytes(), None),
            ("ids", "INT64", [2], np.array([7, -8], np.int64).tobytes(), None),
            ("text", "BYTES", [2], strings([b"a", "bé".encode()]), None),
            ("mask", "BOOL", [2], bytes([1, 0]), None),
            ("half", "FP16", [2], np.array([0.5, -2], np.float16).tobytes(), None),
        ]
    )
    request = parse(body, length)
    feed = request.feed
    np.testing.assert_array_equal(feed["x"], X)
    assert feed["x"].dtype == np.float32
    assert feed["ids"].tolist() == [7, -8] and feed["ids"].dtype == np.int64
    assert feed["text"].tolist() == ["a", "bé"] and feed["text"].dtype == object
    assert feed["mask"].tolist() == [True, False] and feed["mask"].dtype == np.bool_
    assert feed["half"].tolist() == [0.5, -2.0] and feed["half"].dtype == np.float16
    assert all(a.flags.aligned for a in feed.values())


@pytest.mark.parametrize("offset", [128, 129, 130, 131])
def test_binary_data_is_the_bodys_bytes_where_aligned_and_an_aligned_copy_elsewhere(
    offset: int,
) -> None:
    body, length = binary_request([("x", "FP32", [2, 3], X.tobytes(), None)])
    header = body[:length].ljust(offset)  # JSON may end in spaces: the data starts at offset
    body = bytearray(header + X.tobytes())
    x = parse(body, offset).feed["x"]  # type: ignore[arg-type]
    np.testing.assert_array_equal(x, X)
    assert x.flags.aligned
    shared = np.shares_memory(x, np.frombuffer(body, np.uint8))
    assert shared == (offset % 4 == 0), offset


def test_json_and_binary_inputs_mix_and_the_reservation_counts_what_decoding_adds() -> None:
    body, length = binary_request(
        [
            ("x", "FP32", [2, 3], X.tobytes(), None),
            ("ids", "INT64", [2], None, [1, 2]),
        ]
    )
    budget = InflightBytes(10**6)
    request = parse(body, length, budget=budget)
    assert request.feed["ids"].tolist() == [1, 2]
    held = budget.used_bytes
    assert len(body) <= held <= len(body) + X.nbytes + 16  # the body, the JSON array, a copy
    request.release()
    assert budget.used_bytes == 0


@pytest.mark.parametrize(
    ("tensors", "length_delta", "cut", "needle"),
    [
        # "binary_data_size" says 8 where the shape needs 24.
        ([("x", "FP32", [2, 3], X.tobytes()[:8], None)], 0, 0, "takes 24"),
        # The sizes add up to more than the body holds after the header (a truncated body).
        ([("x", "FP32", [2, 3], X.tobytes(), None)], 0, 4, "add up to 24 bytes"),
        # The header length points past the JSON (into the binary part) or before its end.
        ([("x", "FP32", [2, 3], X.tobytes(), None)], 4, 0, "not valid JSON"),
        ([("x", "FP32", [2, 3], X.tobytes(), None)], -4, 0, "not valid JSON"),
        # A wrong dtype, rank or fixed dimension, judged before the data is touched.
        ([("x", "FP64", [2, 3], X.astype(np.float64).tobytes(), None)], 0, 0, "FP32 in the model"),
        ([("x", "FP32", [6], X.tobytes(), None)], 0, 0, "must have rank 2"),
        ([("x", "FP32", [3, 2], X.tobytes(), None)], 0, 0, "must have 3 on axis 1"),
        ([("nope", "FP32", [1], b"\0" * 4, None)], 0, 0, "unknown input(s) 'nope'"),
        # BOOL bytes other than 0 and 1; BYTES that lie about their lengths or are not UTF-8.
        ([("mask", "BOOL", [2], bytes([1, 7]), None)], 0, 0, "other than 0 and 1"),
        ([("text", "BYTES", [2], strings([b"a"]), None)], 0, 0, "ends inside the length"),
        ([("text", "BYTES", [1], struct.pack("<I", 99) + b"ab", None)], 0, 0, "declares 99"),
        ([("text", "BYTES", [1], strings([b"a", b"b"]), None)], 0, 0, "after its 1 elements"),
        ([("text", "BYTES", [1], strings([b"\xff\xfe"]), None)], 0, 0, "not valid UTF-8"),
    ],
)
def test_lying_binary_requests_are_a_400_naming_what_disagrees(
    tensors: Any, length_delta: int, cut: int, needle: str
) -> None:
    body, length = binary_request(tensors)
    body = body[: len(body) - cut]
    assert needle in refused(400, body, length + length_delta)


def test_header_lengths_that_cannot_be_are_refused_before_any_parse() -> None:
    body, length = binary_request([("x", "FP32", [2, 3], X.tobytes(), None)])
    assert "past the end of the" in refused(400, body, len(body) + 1)
    assert "must be the JSON part's length" in refused(400, body, "-3")
    assert "must be the JSON part's length" in refused(400, body, "12abc")
    limits = HttpLimits(max_json_bytes=length - 1)
    assert "send tensors as binary" in refused(413, body, length, limits=limits)
    # Binary sizes declared without the header: the JSON is the whole body.
    header = body[:length]
    assert "has no Inference-Header-Content-Length" in refused(400, header, None)
    both = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [2, 3],
                    "datatype": "FP32",
                    "data": X.ravel().tolist(),
                    "parameters": {"binary_data_size": 24},
                }
            ]
        }
    ).encode()
    assert 'both "data" and "binary_data_size"' in refused(400, both + X.tobytes(), len(both))


def test_a_huge_declared_tensor_is_refused_from_its_shape_with_no_data_sent() -> None:
    for shape, status, needle in (
        ([2**40, 3], 413, "rows, more than"),
        ([60_000, 3], 413, "more than this server's"),  # rows allowed, bytes not
    ):
        doc = {
            "inputs": [
                {
                    "name": "x",
                    "shape": shape,
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": shape[0] * 12},
                }
            ]
        }
        header = json.dumps(doc).encode()
        limits = HttpLimits(max_request_bytes=512 * 1024)
        assert needle in refused(status, header + b"\0" * 12, len(header), limits=limits)


def test_parameters_that_change_the_meaning_are_refused_not_ignored() -> None:
    tensors = [("x", "FP32", [2, 3], X.tobytes(), None)]
    body, length = binary_request(tensors, parameters={"sequence_id": 5})
    assert "sequences" in refused(400, body, length)
    body, length = binary_request(
        tensors, outputs=[{"name": "y", "parameters": {"classification": 3}}]
    )
    assert "top-k" in refused(400, body, length)
    body, length = binary_request(tensors, parameters={"binary_data_output": "yes"})
    assert "must be true or false" in refused(400, body, length)
    # Others (priority, a timeout, anything custom) change nothing here: accepted.
    body, length = binary_request(tensors, parameters={"priority": 1, "timeout": 10, "k": "v"})
    assert parse(body, length).feed["x"].shape == (2, 3)


def _reply(results: dict[str, np.ndarray], **request: Any) -> tuple[dict[str, Any], bytes, Any]:
    body, length = binary_request([("x", "FP32", [2, 3], X.tobytes(), None)], **request)
    parsed = parse(body, length)
    reply = _request.encode_outputs(results, parsed, accept="", model_name="m")
    raw = reply.body()
    split = int(reply.headers.get(HEADER, len(raw)))
    return json.loads(raw[:split]), raw[split:], reply


def test_replies_are_binary_where_asked_per_output_or_for_all() -> None:
    outputs = {
        "y": np.arange(4, dtype=np.float32).reshape(2, 2),
        "names": np.array(["a", "bé"], dtype=object),
        "flags": np.array([True, False]),
    }
    # binary_data_output: every output in binary, in order, sizes in their parameters.
    doc, tail, reply = _reply(outputs, parameters={"binary_data_output": True})
    assert reply.media == "application/octet-stream" and HEADER in reply.headers
    sizes = [o["parameters"]["binary_data_size"] for o in doc["outputs"]]
    assert sizes == [16, 4 + 1 + 4 + 3, 2] and len(tail) == sum(sizes)
    assert all("data" not in o for o in doc["outputs"])
    np.testing.assert_array_equal(np.frombuffer(tail[:16], "<f4").reshape(2, 2), outputs["y"])
    assert tail[16:28] == strings([b"a", "bé".encode()]) and tail[28:] == b"\x01\x00"
    # Per output: binary_data wins over the request's default.
    doc, tail, reply = _reply(
        outputs,
        outputs=[{"name": "y", "parameters": {"binary_data": False}}, {"name": "names"}],
        parameters={"binary_data_output": True},
    )
    assert doc["outputs"][0]["data"] == [0, 1, 2, 3]
    assert doc["outputs"][1]["parameters"] == {"binary_data_size": 12}
    # Nothing asked: JSON, no header, as the protocol's core says.
    doc, tail, reply = _reply(outputs)
    assert reply.media == "application/json" and HEADER not in reply.headers and tail == b""
    assert doc["outputs"][1]["data"] == ["a", "bé"]


def test_a_zero_row_binary_request_is_a_zero_row_feed() -> None:
    body, length = binary_request([("x", "FP32", [0, 3], b"", None)])
    assert parse(body, length).feed["x"].shape == (0, 3)
