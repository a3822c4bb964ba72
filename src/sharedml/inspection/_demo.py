"""The built-in demo model that ``sharedml inspect`` uses when no model is given.

An MLP of :data:`DEMO_LAYERS` fully connected layers (MatMul + Add + Relu) of width
:data:`DEMO_WIDTH` on an input ``x: float32[batch, DEMO_WIDTH]``: 48 MiB of float32 weights stored
inline in the ``.onnx`` file, the way most exporters write models under 2 GB. The batch dimension
is symbolic, so ``--dim batch=8`` has something to override.

The model is generated, not downloaded: deterministic (fixed seed, so every machine builds the
same bytes and sharedml's content-keyed cache reuses one prepared copy), built in well under a
second, and written once into the cache (:mod:`sharedml.cache`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from sharedml.cache._entries import ensure_entry
from sharedml.cache._root import Cache, CacheDir

__all__ = [
    "DEMO_BATCH_DIM",
    "DEMO_LAYERS",
    "DEMO_WIDTH",
    "build_demo_model",
    "demo_model_path",
]

DEMO_LAYERS = 12
DEMO_WIDTH = 1024  # elements: 12 layers x 1024 x 1024 x 4 bytes = 48 MiB of weights
DEMO_BATCH_DIM = "batch"
_SEED = 0
_VERSION = 1  # bump when the model changes, so that caches build the new one
_OPSET = 17
_FILE_NAME = "model.onnx"


def build_demo_model() -> onnx.ModelProto:
    """Build the demo model in memory (deterministic: the same bytes on every machine)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(_SEED)
    scale = np.float32(1.0 / np.sqrt(DEMO_WIDTH))  # keeps activations O(1) through the layers
    nodes = []
    initializers = []
    x = "x"
    for i in range(DEMO_LAYERS):
        w = rng.standard_normal((DEMO_WIDTH, DEMO_WIDTH), dtype=np.float32) * scale
        b = np.full(DEMO_WIDTH, 0.01, dtype=np.float32)
        initializers += [
            numpy_helper.from_array(w, f"fc{i}.weight"),
            numpy_helper.from_array(b, f"fc{i}.bias"),
        ]
        nodes += [
            helper.make_node("MatMul", [x, f"fc{i}.weight"], [f"fc{i}.mm"], name=f"fc{i}_matmul"),
            helper.make_node(
                "Add", [f"fc{i}.mm", f"fc{i}.bias"], [f"fc{i}.pre"], name=f"fc{i}_add"
            ),
            helper.make_node("Relu", [f"fc{i}.pre"], [f"fc{i}.out"], name=f"fc{i}_relu"),
        ]
        x = f"fc{i}.out"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="output"))
    graph = helper.make_graph(
        nodes,
        "sharedml_demo_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [DEMO_BATCH_DIM, DEMO_WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [DEMO_BATCH_DIM, DEMO_WIDTH])],
        initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", _OPSET)],
        producer_name="sharedml-demo",
        doc_string=(
            f"sharedml's demo model: a {DEMO_LAYERS}-layer MLP of width {DEMO_WIDTH}, "
            "deterministic weights, generated on the fly."
        ),
    )
    model.ir_version = 8
    return model


def demo_model_path(cache_dir: CacheDir = None) -> Path:
    """The demo model's file, built into the cache (its ``demo`` entries) on first use.

    Args:
        cache_dir: The cache: a path, a :class:`~sharedml.cache.Cache`, or None for
            :func:`sharedml.cache_dir`.

    Returns:
        The path of the ``.onnx`` file.

    Raises:
        CacheError: the cache folder fails sharedml's permission policy or cannot be written.

    Thread and process safety: safe to call concurrently; the entry appears atomically.
    """

    def build(folder: Path) -> dict[str, str]:
        (folder / _FILE_NAME).write_bytes(build_demo_model().SerializeToString())
        return {"model": f"{DEMO_LAYERS}-layer MLP of width {DEMO_WIDTH}"}

    cache = Cache.at(cache_dir)
    return ensure_entry("demo", f"mlp-v{_VERSION}", build, cache=cache).file(_FILE_NAME)
