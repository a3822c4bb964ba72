"""ONNX's protobuf messages, without importing the ``onnx`` package where that can be avoided.

``import onnx`` is slow (it imports ml_dtypes, whose extension takes most of that time), and a
pool over a model already in the cache needs nothing of onnx but its message classes: it parses
a prepared graph and reads its metadata and external-data entries. So the classes come from
onnx's generated module ``onnx/onnx_ml_pb2.py``, executed on its own (a small fraction of the
import), and the onnx package is imported only by the code that needs its helpers (prepare,
shape inference, the checker). The figures: ``docs/batching.md``, "Serving before the pool is
full".

This is done only with protobuf's ``upb`` backend (the default since protobuf 4.21), where a
message class belongs to its descriptor: the standalone module and ``onnx``'s own resolve to the
very same classes whichever loads first, so messages cross freely between sharedml and onnx
(``tests/test_proto.py`` asserts it). With any other backend, or if the generated module cannot
be found, this module imports onnx and uses its classes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto

__all__ = [
    "AttributeProto",
    "GraphProto",
    "ModelProto",
    "NodeProto",
    "TensorProto",
    "parse_model",
    "pb2",
]

_MODULE_NAME = "sharedml._onnx_ml_pb2"
_lock = threading.Lock()
_module: ModuleType | None = None


def _standalone() -> ModuleType | None:
    """The generated module of onnx, run without the onnx package; None where that is unsafe."""
    try:
        from google.protobuf.internal import api_implementation  # type: ignore[import-untyped]

        if api_implementation.Type() != "upb":
            return None
        spec = importlib.util.find_spec("onnx")  # finds the package without importing it
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "onnx_ml_pb2.py")
    file_spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if file_spec is None or file_spec.loader is None or not os.path.isfile(path):
        return None
    module = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(module)
    except Exception:  # a generated module of another protobuf version: let onnx load its own
        return None
    return module


def pb2() -> ModuleType:
    """The module holding ONNX's message classes (onnx's own once onnx is imported)."""
    global _module
    if _module is None:
        with _lock:
            if _module is None:
                module = None if "onnx" in sys.modules else _standalone()
                if module is None:
                    import onnx

                    module = onnx.onnx_ml_pb2
                _module = module
    return _module


def parse_model(data: bytes) -> ModelProto:
    """Parse a serialized ``ModelProto`` (as ``onnx.load_model_from_string`` does)."""
    model: ModelProto = pb2().ModelProto()
    model.ParseFromString(data)
    return model


def __getattr__(name: str) -> Any:
    if name in ("AttributeProto", "GraphProto", "ModelProto", "NodeProto", "TensorProto"):
        return getattr(pb2(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
