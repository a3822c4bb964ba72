"""The Open Inference Protocol's gRPC messages (``inference.GRPCInferenceService``) and codec.

The messages are those of KServe's ``grpc_predict_v2.proto`` (Apache-2.0), field for field
(Triton's ``grpc_service.proto`` uses the same numbers, plus two parameter kinds kept here:
``double_param`` and ``uint64_param``). They are declared below as data and built at import
into a descriptor pool of their own:

- no generated ``_pb2`` module, hence no protobuf version pinned: generated code since
  protobuf 5 refuses to load under an older runtime, and tritonclient (protobuf < 7) and
  Ray 2.60 (protobuf 7 by default) disagree on which one is installed;
- no clash with clients in the same process: tritonclient and KServe's client register the
  same names (``inference.ModelInferRequest``) in protobuf's default pool, where a second
  registration of a name fails; on the wire, messages are bytes, and these are the same bytes.

``tests/protocol/test_grpc.py`` checks every field against tritonclient's and KServe's
generated descriptors where those packages are installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

from sharedml.protocol._admission import HttpLimits
from sharedml.protocol._kserve import decode_bytes_tensor, encode_bytes_tensor
from sharedml.protocol._tensors import (
    DATATYPES,
    TensorInfo,
    bad,
    check_names,
    check_request_bytes,
    check_tensor,
    datatype_of,
)

__all__ = [
    "PACKAGE",
    "SERVICE",
    "METHODS",
    "GrpcRequest",
    "decode_infer_request",
    "encode_infer_response",
    "message",
]

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

_F = descriptor_pb2.FieldDescriptorProto
_BOOL, _STRING, _BYTES = _F.TYPE_BOOL, _F.TYPE_STRING, _F.TYPE_BYTES
_INT32, _INT64, _UINT32, _UINT64 = _F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64
_FLOAT, _DOUBLE, _MESSAGE = _F.TYPE_FLOAT, _F.TYPE_DOUBLE, _F.TYPE_MESSAGE
_MAP = "map<string, InferParameter>"  # a field of this type is a map of parameters

# message -> fields (name, number, type, repeated, message type); nested messages by name.
_Field = tuple[str, int, Any, bool, str]
_MESSAGES: dict[str, tuple[list[_Field], dict[str, list[_Field]]]] = {
    "ServerLiveRequest": ([], {}),
    "ServerLiveResponse": ([("live", 1, _BOOL, False, "")], {}),
    "ServerReadyRequest": ([], {}),
    "ServerReadyResponse": ([("ready", 1, _BOOL, False, "")], {}),
    "ModelReadyRequest": (
        [("name", 1, _STRING, False, ""), ("version", 2, _STRING, False, "")],
        {},
    ),
    "ModelReadyResponse": ([("ready", 1, _BOOL, False, "")], {}),
    "ServerMetadataRequest": ([], {}),
    "ServerMetadataResponse": (
        [
            ("name", 1, _STRING, False, ""),
            ("version", 2, _STRING, False, ""),
            ("extensions", 3, _STRING, True, ""),
        ],
        {},
    ),
    "ModelMetadataRequest": (
        [("name", 1, _STRING, False, ""), ("version", 2, _STRING, False, "")],
        {},
    ),
    "ModelMetadataResponse": (
        [
            ("name", 1, _STRING, False, ""),
            ("versions", 2, _STRING, True, ""),
            ("platform", 3, _STRING, False, ""),
            ("inputs", 4, _MESSAGE, True, "ModelMetadataResponse.TensorMetadata"),
            ("outputs", 5, _MESSAGE, True, "ModelMetadataResponse.TensorMetadata"),
        ],
        {
            "TensorMetadata": [
                ("name", 1, _STRING, False, ""),
                ("datatype", 2, _STRING, False, ""),
                ("shape", 3, _INT64, True, ""),
            ]
        },
    ),
    "ModelInferRequest": (
        [
            ("model_name", 1, _STRING, False, ""),
            ("model_version", 2, _STRING, False, ""),
            ("id", 3, _STRING, False, ""),
            ("parameters", 4, _MAP, True, ""),
            ("inputs", 5, _MESSAGE, True, "ModelInferRequest.InferInputTensor"),
            ("outputs", 6, _MESSAGE, True, "ModelInferRequest.InferRequestedOutputTensor"),
            ("raw_input_contents", 7, _BYTES, True, ""),
        ],
        {
            "InferInputTensor": [
                ("name", 1, _STRING, False, ""),
                ("datatype", 2, _STRING, False, ""),
                ("shape", 3, _INT64, True, ""),
                ("parameters", 4, _MAP, True, ""),
                ("contents", 5, _MESSAGE, False, "InferTensorContents"),
            ],
            "InferRequestedOutputTensor": [
                ("name", 1, _STRING, False, ""),
                ("parameters", 2, _MAP, True, ""),
            ],
        },
    ),
    "ModelInferResponse": (
        [
            ("model_name", 1, _STRING, False, ""),
            ("model_version", 2, _STRING, False, ""),
            ("id", 3, _STRING, False, ""),
            ("parameters", 4, _MAP, True, ""),
            ("outputs", 5, _MESSAGE, True, "ModelInferResponse.InferOutputTensor"),
            ("raw_output_contents", 6, _BYTES, True, ""),
        ],
        {
            "InferOutputTensor": [
                ("name", 1, _STRING, False, ""),
                ("datatype", 2, _STRING, False, ""),
                ("shape", 3, _INT64, True, ""),
                ("parameters", 4, _MAP, True, ""),
                ("contents", 5, _MESSAGE, False, "InferTensorContents"),
            ]
        },
    ),
    # One of its fields at most (the oneof "parameter_choice").
    "InferParameter": (
        [
            ("bool_param", 1, _BOOL, False, ""),
            ("int64_param", 2, _INT64, False, ""),
            ("string_param", 3, _STRING, False, ""),
            ("double_param", 4, _DOUBLE, False, ""),
            ("uint64_param", 5, _UINT64, False, ""),
        ],
        {},
    ),
    "InferTensorContents": (
        [
            ("bool_contents", 1, _BOOL, True, ""),
            ("int_contents", 2, _INT32, True, ""),
            ("int64_contents", 3, _INT64, True, ""),
            ("uint_contents", 4, _UINT32, True, ""),
            ("uint64_contents", 5, _UINT64, True, ""),
            ("fp32_contents", 6, _FLOAT, True, ""),
            ("fp64_contents", 7, _DOUBLE, True, ""),
            ("bytes_contents", 8, _BYTES, True, ""),
        ],
        {},
    ),
}

# RPC name -> (request message, response message), in the service's order.
METHODS: dict[str, tuple[str, str]] = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
}


def _add_fields(proto: Any, owner: str, fields: list[_Field]) -> None:
    for name, number, kind, repeated, type_name in fields:
        field = proto.field.add(name=name, number=number, json_name=_camel(name))
        field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
        if kind == _MAP:
            entry = proto.nested_type.add(name=_camel(name, upper=True) + "Entry")
            entry.options.map_entry = True
            entry.field.add(
                name="key", number=1, type=_STRING, label=_F.LABEL_OPTIONAL, json_name="key"
            )
            entry.field.add(
                name="value",
                number=2,
                type=_MESSAGE,
                label=_F.LABEL_OPTIONAL,
                type_name=f".{PACKAGE}.InferParameter",
                json_name="value",
            )
            field.type = _MESSAGE
            field.type_name = f".{PACKAGE}.{owner}.{entry.name}"
        else:
            field.type = kind
            if type_name:
                field.type_name = f".{PACKAGE}.{type_name}"
        if owner == "InferParameter":
            field.oneof_index = 0


def _camel(name: str, *, upper: bool = False) -> str:
    head, *rest = name.split("_")
    text = head + "".join(part.title() for part in rest)
    return text[:1].upper() + text[1:] if upper else text


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(
        name="sharedml/grpc_predict_v2.proto", package=PACKAGE, syntax="proto3"
    )
    for name, (fields, nested) in _MESSAGES.items():
        message_proto = proto.message_type.add(name=name)
        for nested_name, nested_fields in nested.items():
            inner = message_proto.nested_type.add(name=nested_name)
            _add_fields(inner, f"{name}.{nested_name}", nested_fields)
        _add_fields(message_proto, name, fields)
        if name == "InferParameter":
            message_proto.oneof_decl.add(name="parameter_choice")
    service = proto.service.add(name=SERVICE.rpartition(".")[2])
    for method, (request, response) in METHODS.items():
        service.method.add(
            name=method, input_type=f".{PACKAGE}.{request}", output_type=f".{PACKAGE}.{response}"
        )
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def _message_class(name: str) -> Any:
    descriptor = _POOL.FindMessageTypeByName(f"{PACKAGE}.{name}")
    get = getattr(message_factory, "GetMessageClass", None)
    if get is not None:
        return get(descriptor)
    return message_factory.MessageFactory(_POOL).GetPrototype(descriptor)  # protobuf < 4.21


_CLASSES: dict[str, Any] = {}
for _name in _MESSAGES:
    _cls = _message_class(_name)
    # Ray Serve pickles request messages between its proxy and a replica: pickle finds a class
    # by module and name, so each lives here under its own.
    _cls.__module__ = __name__
    _cls.__qualname__ = _name
    _CLASSES[_name] = _cls
    globals()[_name] = _cls
del _name, _cls


def message(name: str) -> Any:
    """The message class ``name`` (``"ModelInferRequest"``...)."""
    return _CLASSES[name]


# datatype -> the InferTensorContents field that carries it (FP16 only travels raw).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_UNSUPPORTED_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


class GrpcRequest:
    """A decoded ``ModelInferRequest``: the feed, the outputs asked for, how to reply.

    Attributes:
        feed: Input arrays by name.
        output_names: The outputs asked for (None: all).
        request_id: The request's ``id``.
        raw: Whether the inputs came as ``raw_input_contents`` (the reply then uses
            ``raw_output_contents``, as clients that send raw expect).
        nbytes: Bytes decoding added to the message's own (copies of raw data, arrays).
    """

    def __init__(
        self,
        feed: dict[str, np.ndarray],
        output_names: list[str] | None,
        request_id: str,
        raw: bool,
        nbytes: int,
    ) -> None:
        self.feed = feed
        self.output_names = output_names
        self.request_id = request_id
        self.raw = raw
        self.nbytes = nbytes


def _parameter(value: Any) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


def decode_infer_request(
    request: Any, inputs: Mapping[str, TensorInfo], limits: HttpLimits
) -> GrpcRequest:
    """A ``ModelInferRequest``'s feed, judged from its declared shapes before data is read.

    Raises:
        RequestError: 400 for a request that lies or does not fit the model, 413 beyond
            ``limits``.
    """
    for key in _UNSUPPORTED_PARAMETERS:
        if key in request.parameters and _parameter(request.parameters[key]) not in (
            None,
            0,
            "",
            False,
        ):
            raise bad(
                f'The request sets parameter "{key}": sequences (stateful models) are not '
                "supported by this server."
            )
    items = list(request.inputs)
    if not items:
        raise bad("The request has no inputs.")
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(items):
        raise bad(
            f"The request has {len(items)} inputs but {len(raw)} raw_input_contents: send raw "
            "data for every input, in the order of inputs, or for none."
        )
    declared: list[tuple[str, str, list[int]]] = []
    total = 0
    for item in items:
        name, datatype, shape = item.name, item.datatype, list(item.shape)
        what = f"Input '{name[:80]}'"
        if datatype not in DATATYPES:
            raise bad(f"{what}: datatype {datatype[:80]!r} is not one of {', '.join(DATATYPES)}.")
        check_names([name], inputs, "The request")
        model = inputs[name]
        if model.datatype is not None and model.datatype != datatype:
            raise bad(f"{what} is {model.datatype} in the model; the request sends {datatype}.")
        if [n for n, _, _ in declared].count(name):
            raise bad(f"Input '{name[:80]}' is given twice.")
        total += check_tensor(name, np.dtype(DATATYPES[datatype]), shape, inputs, limits.max_rows)
        declared.append((name, datatype, shape))
    check_request_bytes(total, limits.max_request_bytes, "The request's shapes declare")
    feed: dict[str, np.ndarray] = {}
    added = 0
    for index, (item, (name, datatype, shape)) in enumerate(zip(items, declared, strict=True)):
        what = f"Input '{name}'"
        count = math.prod(shape)
        if raw:
            if item.HasField("contents"):
                raise bad(f"{what} has contents although the request sends raw_input_contents.")
            data = raw[index]  # a copy of the message's bytes
            added += len(data)
            feed[name] = _from_raw(memoryview(data), datatype, shape, count, what)
            continue
        if datatype == "FP16":
            raise bad(f"{what} is FP16, which travels only as raw_input_contents.")
        values = getattr(item.contents, _CONTENTS[datatype])
        if len(values) != count:
            raise bad(
                f"{what} has {len(values)} values in contents.{_CONTENTS[datatype]}, but its "
                f"shape {shape} needs {count}."
            )
        array = _from_contents(values, datatype, what)
        added += array.nbytes if array.dtype != object else 8 * array.size
        feed[name] = array.reshape(shape)
    outputs = None
    if request.outputs:
        outputs = []
        for spec in request.outputs:
            if "classification" in spec.parameters and _parameter(
                spec.parameters["classification"]
            ) not in (None, 0):
                raise bad(
                    f"Output '{spec.name[:80]}' asks for \"classification\" (top-k classes), "
                    "which this server does not compute: ask for the output and take the top k "
                    "yourself."
                )
            outputs.append(spec.name)
    return GrpcRequest(feed, outputs, request.id, bool(raw), added)


def _from_raw(data: memoryview, datatype: str, shape: list[int], count: int, what: str) -> Any:
    if datatype == "BYTES":
        return decode_bytes_tensor(data, count, what).reshape(shape)
    dtype = np.dtype(DATATYPES[datatype]).newbyteorder("<")
    if len(data) != count * dtype.itemsize:
        raise bad(
            f"{what} has {len(data)} bytes of raw_input_contents, but its shape {shape} of "
            f"{datatype} takes {count * dtype.itemsize}."
        )
    array = np.frombuffer(data, dtype=dtype, count=count)
    if not array.dtype.isnative:
        array = array.astype(dtype.newbyteorder("="))
    if datatype == "BOOL" and array.size and array.view(np.uint8).max() > 1:
        raise bad(f"{what} holds BOOL bytes other than 0 and 1.")
    return array.reshape(shape)


def _from_contents(values: Sequence[Any], datatype: str, what: str) -> np.ndarray:
    if datatype == "BYTES":
        try:
            texts = [bytes(v).decode("utf-8") for v in values]
        except UnicodeDecodeError as exc:
            raise bad(f"{what} holds bytes that are not valid UTF-8 ({exc}).") from None
        array = np.empty(len(texts), dtype=object)
        array[:] = texts
        return array
    target = np.dtype(DATATYPES[datatype])
    wide = np.asarray(values)
    if target.kind in "iu" and wide.size:
        info = np.iinfo(target)
        low, high = int(wide.min()), int(wide.max())
        if low < info.min or high > info.max:
            raise bad(
                f"{what} holds {low if low < info.min else high}, outside the range of "
                f"{datatype} ({info.min} to {info.max})."
            )
    return wide.astype(target)


def encode_infer_response(
    outputs: Mapping[str, np.ndarray],
    *,
    model_name: str,
    model_version: str,
    request_id: str,
    raw: bool,
) -> Any:
    """A ``ModelInferResponse`` for ``outputs``: raw contents where asked (or needed by FP16)."""
    response = message("ModelInferResponse")(
        model_name=model_name, model_version=model_version, id=request_id
    )
    arrays = {name: np.asarray(value) for name, value in outputs.items()}
    datatypes = {name: datatype_of(array) for name, array in arrays.items()}
    raw = raw or any(d not in _CONTENTS for d in datatypes.values())
    for name, array in arrays.items():
        tensor = response.outputs.add(name=name, datatype=datatypes[name], shape=array.shape)
        if raw:
            if datatypes[name] == "BYTES":
                response.raw_output_contents.append(encode_bytes_tensor(array))
            else:
                little = array.astype(array.dtype.newbyteorder("<"), copy=False)
                response.raw_output_contents.append(np.ascontiguousarray(little).tobytes())
        elif datatypes[name] == "BYTES":
            tensor.contents.bytes_contents.extend(
                v if isinstance(v, bytes) else str(v).encode("utf-8")
                for v in array.reshape(-1).tolist()
            )
        else:
            getattr(tensor.contents, _CONTENTS[datatypes[name]]).extend(array.reshape(-1).tolist())
    return response
