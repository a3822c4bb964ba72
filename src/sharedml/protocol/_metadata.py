"""The Open Inference Protocol's metadata documents: server, model, health."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sharedml.protocol._tensors import TensorInfo

__all__ = ["EXTENSIONS", "MODEL_VERSION", "PLATFORM", "model_metadata", "server_metadata"]

PLATFORM = "onnxruntime_onnx"  # Triton's name for an ONNX Runtime model: clients know it
MODEL_VERSION = "1"  # one version per served name
# What this server implements beyond the core protocol, as Triton names its extensions.
EXTENSIONS = ("binary_tensor_data", "parameters")


def server_metadata(version: str) -> dict[str, Any]:
    """``GET /v2``: the server's name, version and extensions."""
    return {"name": "sharedml", "version": version, "extensions": list(EXTENSIONS)}


def model_metadata(
    name: str, inputs: Mapping[str, TensorInfo], outputs: Mapping[str, TensorInfo]
) -> dict[str, Any]:
    """``GET /v2/models/<name>``: inputs and outputs with datatypes and shapes (-1: dynamic)."""

    def describe(infos: Mapping[str, TensorInfo]) -> list[dict[str, Any]]:
        return [
            {"name": i.name, "datatype": i.datatype or i.type, "shape": list(i.shape)}
            for i in infos.values()
        ]

    return {
        "name": name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": describe(inputs),
        "outputs": describe(outputs),
    }
