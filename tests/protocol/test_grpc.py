"""The gRPC messages and codec: field for field those of the clients, lies refused."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from sharedml.protocol import _grpc, _tensors
from sharedml.protocol._admission import HttpLimits
from sharedml.protocol._tensors import RequestError


def describe(file_descriptor: Any, names: list[str]) -> dict[str, Any]:
    """Every field of the named messages (nested too): number, type, label, message type."""
    found: dict[str, Any] = {}

    def walk(message: Any) -> None:
        for field in message.fields:
            sub = field.message_type.full_name if field.message_type else ""
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                sub = "map:" + field.message_type.fields_by_name["value"].message_type.full_name
            repeated = getattr(field, "is_repeated", None)
            label = repeated if repeated is not None else field.label == 3
            found[field.full_name] = [field.number, field.type, bool(label), sub]
        for nested in message.nested_types:
            if not nested.GetOptions().map_entry:
                walk(nested)

    for name in names:
        walk(file_descriptor.message_types_by_name[name])
    return found


OURS = describe(_grpc.message("ModelInferRequest").DESCRIPTOR.file, list(_grpc._MESSAGES))


def test_every_field_is_the_same_as_tritonclients() -> None:
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    theirs = describe(service_pb2.DESCRIPTOR, list(_grpc._MESSAGES))
    assert theirs == OURS
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method, (request, response) in _grpc.METHODS.items():
        rpc = service.methods_by_name[method]
        assert (rpc.input_type.name, rpc.output_type.name) == (request, response)


def test_every_field_of_kserves_proto_is_the_same_here() -> None:
    """KServe's own generated module (a child process: it clashes with tritonclient's)."""
    import os

    python = os.environ.get("SHAREDML_KSERVE_PYTHON") or sys.executable  # see tests/_clients.py
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('kserve') is not None)"],
        capture_output=True,
        text=True,
    )
    if probe.stdout.strip() != "True":
        pytest.skip(f"KServe's client is not installed for {python} (SHAREDML_KSERVE_PYTHON)")
    code = (
        "import json, sys\n"
        "from typing import Any\n"
        "from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb2\n"
        f"exec({_describe_source()!r})\n"
        "known = pb2.DESCRIPTOR.message_types_by_name\n"
        "names = [n for n in json.loads(sys.argv[1]) if n in known]\n"
        "print(json.dumps(describe(pb2.DESCRIPTOR, names)))\n"
    )
    done = subprocess.run(
        [python, "-c", code, json.dumps(list(_grpc._MESSAGES))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout)
    # KServe's InferParameter has three kinds; Triton's (and ours) two more.
    extra = {"inference.InferParameter.double_param", "inference.InferParameter.uint64_param"}
    assert set(OURS) - set(theirs) == extra
    assert {k: v for k, v in OURS.items() if k not in extra} == theirs


def _describe_source() -> str:
    import inspect

    return inspect.getsource(describe)


class _Arg:
    def __init__(self, name: str, type_: str, shape: list[Any]) -> None:
        self.name, self.type, self.shape = name, type_, shape


INPUTS = _tensors.tensor_infos(
    [
        _Arg("x", "tensor(float)", ["batch", 3]),
        _Arg("small", "tensor(int8)", ["batch"]),
        _Arg("text", "tensor(string)", ["batch"]),
        _Arg("mask", "tensor(bool)", ["batch"]),
        _Arg("half", "tensor(float16)", ["batch"]),
    ]
)
X = np.arange(6, dtype=np.float32).reshape(2, 3)


def request(*tensors: tuple[str, str, list[int]], raw: list[bytes] | None = None) -> Any:
    message = _grpc.message("ModelInferRequest")(model_name="m", id="7")
    for name, datatype, shape in tensors:
        message.inputs.add(name=name, datatype=datatype, shape=shape)
    message.raw_input_contents.extend(raw or [])
    return message


def decode(message: Any, limits: HttpLimits | None = None) -> _grpc.GrpcRequest:
    return _grpc.decode_infer_request(message, INPUTS, limits or HttpLimits())


def refused(message: Any, status: int = 400, **kw: Any) -> str:
    with pytest.raises(RequestError) as info:
        decode(message, **kw)
    assert info.value.status == status, info.value.message
    return info.value.message


def test_raw_and_typed_contents_decode_to_the_model_dtypes() -> None:
    raw = request(
        ("x", "FP32", [2, 3]),
        ("text", "BYTES", [2]),
        ("half", "FP16", [1]),
        raw=[
            X.tobytes(),
            struct.pack("<I", 2) + "é".encode() + struct.pack("<I", 0),
            np.float16(1.5).tobytes(),
        ],
    )
    decoded = decode(raw)
    np.testing.assert_array_equal(decoded.feed["x"], X)
    assert decoded.feed["text"].tolist() == ["é", ""]
    assert decoded.feed["half"].tolist() == [1.5] and decoded.raw and decoded.request_id == "7"
    typed = request(("x", "FP32", [2, 3]), ("small", "INT8", [2]), ("mask", "BOOL", [2]))
    typed.inputs[0].contents.fp32_contents.extend(X.ravel().tolist())
    typed.inputs[1].contents.int_contents.extend([-128, 127])
    typed.inputs[2].contents.bool_contents.extend([True, False])
    decoded = decode(typed)
    assert not decoded.raw and decoded.feed["small"].dtype == np.int8
    assert decoded.feed["small"].tolist() == [-128, 127]
    assert decoded.feed["mask"].tolist() == [True, False]
    # Replies: raw where the request was raw, typed contents otherwise.
    outputs = {"y": X, "names": np.array(["a", "b"], dtype=object)}
    reply = _grpc.encode_infer_response(
        outputs, model_name="m", model_version="1", request_id="7", raw=True
    )
    assert len(reply.raw_output_contents) == 2
    np.testing.assert_array_equal(
        np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, 3), X
    )
    reply = _grpc.encode_infer_response(
        outputs, model_name="m", model_version="1", request_id="7", raw=False
    )
    assert list(reply.outputs[0].contents.fp32_contents) == X.ravel().tolist()
    assert list(reply.outputs[1].contents.bytes_contents) == [b"a", b"b"]


def test_lying_grpc_requests_are_refused_naming_what_disagrees() -> None:
    assert "takes 24" in refused(request(("x", "FP32", [2, 3]), raw=[X.tobytes()[:20]]))
    assert "but 1 raw_input_contents" in refused(
        request(("x", "FP32", [2, 3]), ("mask", "BOOL", [1]), raw=[X.tobytes()])
    )
    typed = request(("x", "FP32", [2, 3]))
    typed.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    assert "has 2 values" in refused(typed)
    small = request(("small", "INT8", [1]))
    small.inputs[0].contents.int_contents.append(300)
    assert "outside the range" in refused(small)
    assert "travels only as raw" in refused(request(("half", "FP16", [1])))
    assert "other than 0 and 1" in refused(request(("mask", "BOOL", [1]), raw=[b"\x02"]))
    assert "FP32 in the model" in refused(request(("x", "FP64", [1, 3]), raw=[bytes(24)]))
    assert "must have rank 2" in refused(request(("x", "FP32", [3]), raw=[bytes(12)]))
    assert "unknown input(s) 'nope'" in refused(request(("nope", "FP32", [1]), raw=[bytes(4)]))
    assert "given twice" in refused(
        request(("mask", "BOOL", [1]), ("mask", "BOOL", [1]), raw=[b"\x01", b"\x01"])
    )
    assert "declares 99" in refused(
        request(("text", "BYTES", [1]), raw=[struct.pack("<I", 99) + b"ab"])
    )
    huge = request(("x", "FP32", [2**40, 3]), raw=[bytes(12)])
    assert "rows" in refused(huge, 413)
    wide = request(("x", "FP32", [60_000, 3]), raw=[bytes(12)])
    assert "more than this server's" in refused(
        wide, 413, limits=HttpLimits(max_request_bytes=1000)
    )
    with_parameter = request(("mask", "BOOL", [1]), raw=[b"\x01"])
    with_parameter.parameters["sequence_id"].int64_param = 3
    assert "sequences" in refused(with_parameter)
    top_k = request(("mask", "BOOL", [1]), raw=[b"\x01"])
    top_k.outputs.add(name="y").parameters["classification"].int64_param = 2
    assert "top-k" in refused(top_k)
