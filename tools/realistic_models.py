"""Deterministic generators of benchmark models with real architectures.

Each generator builds an ONNX graph with ``onnx.helper`` that follows the layout
exporters produce for a well-known architecture (BERT-base, ResNet-50,
GPT-2-small, a plain MLP), at the real parameter count, filled with random
weights. Nothing is downloaded, so benchmarks can run on an offline machine and
still see the tensor sizes, tensor counts and operator mix of real models.

Every generator has the signature::

    NAME(path, *, size="full", seed=0, weights_as="initializer",
         external_data=False) -> ModelInfo

* ``size="tiny"`` keeps the architecture but shrinks depth and width so the
  model is well under 5 MB and builds and runs in milliseconds (for tests).
* ``weights_as="constant"`` stores every tensor as the output of a ``Constant``
  node instead of a graph initializer, the way many exporters emit models. The
  random stream is consumed in the same order in both modes, so both give
  identical outputs for the same seed.
* The same arguments always produce a byte-identical file.

Command line::

    python tools/realistic_models.py NAME -o OUT.onnx [--size tiny|full]
        [--seed N] [--weights-as initializer|constant] [--external-data]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

__all__ = [
    "REGISTRY",
    "ModelInfo",
    "bert_like",
    "gpt2_like",
    "gru_like",
    "main",
    "mlp",
    "resnet_like",
    "sample_inputs",
    "unet1d_like",
    "unet_like",
]

OPSET = 17  # first opset with LayerNormalization
# Pinned rather than onnx's default so files do not change with the onnx
# version and stay loadable by older onnxruntime releases (IR 8 = ORT >= 1.11).
IR_VERSION = 8

Dim = int | str
"""A dimension: a fixed size or a symbolic name such as ``"batch"``."""

_MIB = 1 << 20


@dataclass(frozen=True)
class ModelInfo:
    """Description of a generated model.

    Attributes:
        path: Where the ``.onnx`` file was written.
        name: Generator and size, e.g. ``"bert_like-full"``.
        weights_bytes: Total bytes of all stored tensors (weights plus the few
            small shape constants): the payload a session has to load. ORT may
            hold more (prepacked MatMul copies, folded constants).
        inputs: Input name -> (numpy dtype, shape); symbolic dimensions are
            named ``"batch"`` and ``"seq"``.
        description: One human-readable line about the architecture.
        outputs: Output name -> (numpy dtype, shape), same conventions.
        vocab_size: Exclusive upper bound for token ids, if the model has any.
        max_seq: Longest sequence the model accepts, if limited.
    """

    path: str
    name: str
    weights_bytes: int
    inputs: dict[str, tuple[np.dtype, tuple[Dim, ...]]] = field(hash=False)
    description: str
    outputs: dict[str, tuple[np.dtype, tuple[Dim, ...]]] = field(default_factory=dict, hash=False)
    vocab_size: int | None = None
    max_seq: int | None = None


class _Builder:
    """Accumulates nodes and tensors for one graph.

    Weights are drawn from one ``numpy.random.Generator`` in creation order and
    written straight into the ``ModelProto`` being built, so besides that proto
    only one weight (as numpy array and bytes) is alive at a time. Building a
    list of TensorProtos and passing it to ``helper.make_graph`` /
    ``make_model`` would instead copy every weight twice more.
    """

    def __init__(self, seed: int, weights_as: str) -> None:
        if weights_as not in ("initializer", "constant"):
            raise ValueError(f"weights_as must be 'initializer' or 'constant', not {weights_as!r}")
        self._rng = np.random.default_rng(seed)
        self._as_constant = weights_as == "constant"
        self.proto = onnx.ModelProto()
        self.graph = self.proto.graph
        self.weights_bytes = 0
        self._small_consts: dict[tuple[str, tuple[int, ...], bytes], str] = {}
        self._counter = 0
        self.scope = ""

    def _store(self, name: str, array: np.ndarray) -> str:
        if self._as_constant:
            node = self.graph.node.add()
            node.name = f"{name}/Constant"
            node.op_type = "Constant"
            node.output.append(name)
            attr = node.attribute.add()
            attr.name = "value"
            attr.type = onnx.AttributeProto.TENSOR
            tensor = attr.t
        else:
            tensor = self.graph.initializer.add()
        # Same encoding as numpy_helper.from_array (little-endian raw_data),
        # but filled in place instead of built and then copied.
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.raw_data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        self.weights_bytes += array.nbytes
        return name

    def param(self, name: str, shape: Sequence[int], std: float, mean: float = 0.0) -> str:
        """Adds a float32 weight drawn from N(mean, std**2).

        Args:
            name: Tensor name (HF-style dotted names make graphs easy to read).
            shape: Tensor shape.
            std: Standard deviation.
            mean: Mean; LayerNorm scales use 1 so they stay near identity.

        Returns:
            The tensor name, to be used as a node input.
        """
        array = self._rng.standard_normal(tuple(shape), dtype=np.float32)
        array *= np.float32(std)
        if mean:
            array += np.float32(mean)
        return self._store(name, array)

    def const(self, value: Any, dtype: type | np.dtype) -> str:
        """Adds (or reuses) a small constant such as a Reshape target shape.

        Identical constants are stored once, as exporters do, so a 12-layer
        model has one ``[0, 0, 12, 64]`` tensor rather than twelve.

        Args:
            value: Scalar or nested sequence.
            dtype: Numpy dtype of the constant.

        Returns:
            The tensor name.
        """
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        name = self._small_consts.get(key)
        if name is None:
            name = f"const_{len(self._small_consts)}"
            self._small_consts[key] = name
            self._store(name, array)
        return name

    def op(self, op_type: str, inputs: Sequence[str], n_outputs: int = 1, **attrs: Any) -> Any:
        """Appends a node.

        Args:
            op_type: ONNX operator type.
            inputs: Input tensor names.
            n_outputs: Number of outputs.
            **attrs: Node attributes.

        Returns:
            The output name, or a list of names if ``n_outputs > 1``.
        """
        self._counter += 1
        node_name = f"{self.scope}/{op_type}_{self._counter}"
        outputs = [f"{node_name}_output_{i}" for i in range(n_outputs)]
        self.graph.node.append(
            helper.make_node(op_type, list(inputs), outputs, name=node_name, **attrs)
        )
        return outputs[0] if n_outputs == 1 else outputs

    def rename_output(self, tensor: str, new_name: str) -> str:
        """Renames the output of the last node (to give graph outputs nice names)."""
        node = self.graph.node[-1]
        if list(node.output) != [tensor]:
            raise ValueError(f"{tensor} is not the only output of the last node")
        node.output[0] = new_name
        return new_name

    def linear(self, x: str, prefix: str, d_in: int, d_out: int, std: float) -> str:
        """MatMul + Add with a [d_in, d_out] weight, as PyTorch exporters emit Linear."""
        w = self.param(f"{prefix}.weight", (d_in, d_out), std)
        b = self.param(f"{prefix}.bias", (d_out,), 0.02)
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def layer_norm(self, x: str, prefix: str, dim: int, eps: float) -> str:
        """LayerNormalization over the last axis with near-identity affine params."""
        gamma = self.param(f"{prefix}.weight", (dim,), 0.02, mean=1.0)
        beta = self.param(f"{prefix}.bias", (dim,), 0.02)
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=eps)

    def model(
        self,
        graph_name: str,
        inputs: dict[str, tuple[np.dtype, tuple[Dim, ...]]],
        outputs: dict[str, tuple[np.dtype, tuple[Dim, ...]]],
    ) -> onnx.ModelProto:
        """Completes the ModelProto (I/O, pinned opset and IR version) and returns it."""
        for spec, field_ in ((inputs, self.graph.input), (outputs, self.graph.output)):
            for name, (dtype, shape) in spec.items():
                elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
                field_.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        self.graph.name = graph_name
        self.proto.ir_version = IR_VERSION
        self.proto.producer_name = "sharedml.tools.realistic_models"
        self.proto.opset_import.append(helper.make_opsetid("", OPSET))
        return self.proto


def _check_size(size: str) -> None:
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', not {size!r}")


def _save(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool) -> str:
    """Writes ``model`` to ``path``, optionally with weights in ``<stem>.data``.

    External data is marked by hand instead of via
    ``onnx.save_model(save_as_external_data=True, ...)`` because that path
    checks for an existing location relative to the *current directory* (and
    raises spuriously) while ``save_external_data`` appends to an existing data
    file, which would make regenerated files grow and differ. The resulting
    layout is the same as onnx's ``all_tensors_to_one_file=True`` with the
    default 1 KiB threshold.

    Args:
        model: The model; with ``external_data`` its tensors lose raw_data.
        path: Destination ``.onnx`` path.
        external_data: Whether to move tensors of >= 1 KiB to ``<stem>.data``.

    Returns:
        ``path`` as a string.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if external_data:
        location = Path(path).stem + ".data"
        data_path = os.path.join(directory, location)
        # onnx appends to an existing data file, so start from an empty one;
        # creating it here also gives it umask permissions (onnx creates 0600).
        with open(data_path, "wb"):
            pass
        tensors = list(model.graph.initializer) + [
            attr.t
            for node in model.graph.node
            if node.op_type == "Constant"
            for attr in node.attribute
            if attr.name == "value"
        ]
        for tensor in tensors:
            # ByteSize, not len(raw_data): reading raw_data copies the bytes.
            if tensor.ByteSize() >= 1024:
                set_external_data(tensor, location)
    onnx.save_model(model, path)
    return path


def _info(
    path: str,
    name: str,
    builder: _Builder,
    inputs: dict[str, tuple[np.dtype, tuple[Dim, ...]]],
    outputs: dict[str, tuple[np.dtype, tuple[Dim, ...]]],
    description: str,
    **extra: Any,
) -> ModelInfo:
    return ModelInfo(
        path=path,
        name=name,
        weights_bytes=builder.weights_bytes,
        inputs=inputs,
        description=description,
        outputs=outputs,
        **extra,
    )


# --------------------------------------------------------------------------- BERT


def bert_like(
    path: str | os.PathLike,
    *,
    size: str = "full",
    seed: int = 0,
    weights_as: str = "initializer",
    external_data: bool = False,
) -> ModelInfo:
    """Writes a BERT-base-like encoder (no pooler), laid out like a HF export.

    Full: 12 post-LN layers, hidden 768, 12 heads, FFN 3072, vocab 30522,
    512 positions (~109M params, ~436 MB fp32). Tiny: 2 layers, hidden 64,
    4 heads, FFN 256, vocab 1000, 128 positions.

    Args:
        path: Output ``.onnx`` path.
        size: ``"full"`` or ``"tiny"``.
        seed: Seed for the weights.
        weights_as: ``"initializer"`` or ``"constant"``.
        external_data: Store tensors in ``<stem>.data`` beside the model.

    Returns:
        ModelInfo with inputs ``input_ids`` and ``attention_mask`` (int64
        [batch, seq]) and output ``last_hidden_state`` (float32
        [batch, seq, hidden]).
    """
    _check_size(size)
    if size == "full":
        layers, hidden, heads, ffn, vocab, max_pos = 12, 768, 12, 3072, 30522, 512
    else:
        layers, hidden, heads, ffn, vocab, max_pos = 2, 64, 4, 256, 1000, 128
    head_dim = hidden // heads
    eps = 1e-12
    b = _Builder(seed, weights_as)
    i64, f32 = np.int64, np.float32

    b.scope = "/embeddings"
    word = b.param("embeddings.word_embeddings.weight", (vocab, hidden), 0.02)
    pos = b.param("embeddings.position_embeddings.weight", (max_pos, hidden), 0.02)
    token_type = b.param("embeddings.token_type_embeddings.weight", (2, hidden), 0.02)
    ids_shape = b.op("Shape", ["input_ids"])
    seq_len = b.op("Gather", [ids_shape, b.const(1, i64)], axis=0)
    position_ids = b.op("Range", [b.const(0, i64), seq_len, b.const(1, i64)])
    x = b.op("Gather", [word, "input_ids"], axis=0)
    x = b.op("Add", [x, b.op("Gather", [pos, position_ids], axis=0)])
    # No token_type_ids input: every token is segment 0, as in single-segment use.
    x = b.op("Add", [x, b.op("Gather", [token_type, b.const(0, i64)], axis=0)])
    x = b.layer_norm(x, "embeddings.LayerNorm", hidden, eps)

    # Extended attention mask: [b, s] -> [b, 1, 1, s], 0 where attended, -1e4 elsewhere.
    b.scope = "/mask"
    mask = b.op("Unsqueeze", ["attention_mask", b.const([1, 2], i64)])
    mask = b.op("Cast", [mask], to=TensorProto.FLOAT)
    mask = b.op("Sub", [b.const(1.0, f32), mask])
    mask = b.op("Mul", [mask, b.const(-10000.0, f32)])

    split_heads = b.const([0, 0, heads, head_dim], i64)
    merge_heads = b.const([0, 0, hidden], i64)
    scale = b.const(math.sqrt(head_dim), f32)
    for layer in range(layers):
        p = f"encoder.layer.{layer}"
        b.scope = f"/encoder/layer.{layer}/attention"
        q = b.linear(x, f"{p}.attention.self.query", hidden, hidden, 0.02)
        k = b.linear(x, f"{p}.attention.self.key", hidden, hidden, 0.02)
        v = b.linear(x, f"{p}.attention.self.value", hidden, hidden, 0.02)
        q = b.op("Transpose", [b.op("Reshape", [q, split_heads])], perm=[0, 2, 1, 3])
        k = b.op("Transpose", [b.op("Reshape", [k, split_heads])], perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [v, split_heads])], perm=[0, 2, 1, 3])
        scores = b.op("Div", [b.op("MatMul", [q, k]), scale])
        probs = b.op("Softmax", [b.op("Add", [scores, mask])], axis=-1)
        ctx = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        ctx = b.op("Reshape", [ctx, merge_heads])
        attn = b.linear(ctx, f"{p}.attention.output.dense", hidden, hidden, 0.02)
        x = b.layer_norm(b.op("Add", [attn, x]), f"{p}.attention.output.LayerNorm", hidden, eps)

        b.scope = f"/encoder/layer.{layer}/ffn"
        h = b.linear(x, f"{p}.intermediate.dense", hidden, ffn, 0.02)
        # Exact GELU, spelled the way torch.onnx exports it before opset 20.
        erf = b.op("Erf", [b.op("Div", [h, b.const(math.sqrt(2.0), f32)])])
        h = b.op("Mul", [h, b.op("Add", [erf, b.const(1.0, f32)])])
        h = b.op("Mul", [h, b.const(0.5, f32)])
        h = b.linear(h, f"{p}.output.dense", ffn, hidden, 0.02)
        x = b.layer_norm(b.op("Add", [h, x]), f"{p}.output.LayerNorm", hidden, eps)
    x = b.rename_output(x, "last_hidden_state")

    inputs = {
        "input_ids": (np.dtype(i64), ("batch", "seq")),
        "attention_mask": (np.dtype(i64), ("batch", "seq")),
    }
    outputs = {"last_hidden_state": (np.dtype(f32), ("batch", "seq", hidden))}
    model = b.model("bert_like", inputs, outputs)
    path = _save(model, path, external_data)
    return _info(
        path,
        f"bert_like-{size}",
        b,
        inputs,
        outputs,
        f"BERT-like encoder: {layers} layers, hidden {hidden}, {heads} heads, "
        f"FFN {ffn}, vocab {vocab}",
        vocab_size=vocab,
        max_seq=max_pos,
    )


# --------------------------------------------------------------------------- GPT-2


def gpt2_like(
    path: str | os.PathLike,
    *,
    size: str = "full",
    seed: int = 0,
    weights_as: str = "initializer",
    external_data: bool = False,
    tie_word_embeddings: bool = True,
) -> ModelInfo:
    """Writes a GPT-2-small-like decoder without KV cache.

    Full: 12 pre-LN layers, hidden 768, 12 heads, FFN 3072, vocab 50257,
    context 1024 (~124M params, ~498 MB fp32 with tied embeddings). Tiny:
    2 layers, hidden 64, 4 heads, vocab 1000, context 128.

    The tied LM head is ``Gemm(h, wte, transB=1)`` so the embedding matrix is
    stored once; a ``MatMul`` with a transposed copy would make ORT's constant
    folding materialise a second 154 MB tensor.

    Args:
        path: Output ``.onnx`` path.
        size: ``"full"`` or ``"tiny"``.
        seed: Seed for the weights.
        weights_as: ``"initializer"`` or ``"constant"``.
        external_data: Store tensors in ``<stem>.data`` beside the model.
        tie_word_embeddings: Reuse the token embedding as LM head (as GPT-2
            does); if False, add a separate ``lm_head.weight`` [hidden, vocab]
            (+154 MB at full size) used through ``MatMul``.

    Returns:
        ModelInfo with input ``input_ids`` (int64 [batch, seq]) and output
        ``logits`` (float32 [batch, seq, vocab]).
    """
    _check_size(size)
    if size == "full":
        layers, hidden, heads, vocab, ctx_len = 12, 768, 12, 50257, 1024
    else:
        layers, hidden, heads, vocab, ctx_len = 2, 64, 4, 1000, 128
    ffn = 4 * hidden
    head_dim = hidden // heads
    eps = 1e-5
    # GPT-2 scales residual projections by 1/sqrt(2 * layers) at init.
    proj_std = 0.02 / math.sqrt(2 * layers)
    b = _Builder(seed, weights_as)
    i64, f32 = np.int64, np.float32

    b.scope = "/embeddings"
    wte = b.param("transformer.wte.weight", (vocab, hidden), 0.02)
    wpe = b.param("transformer.wpe.weight", (ctx_len, hidden), 0.01)
    ids_shape = b.op("Shape", ["input_ids"])
    seq_len = b.op("Gather", [ids_shape, b.const(1, i64)], axis=0)
    position_ids = b.op("Range", [b.const(0, i64), seq_len, b.const(1, i64)])
    x = b.op("Gather", [wte, "input_ids"], axis=0)
    x = b.op("Add", [x, b.op("Gather", [wpe, position_ids], axis=0)])

    # Causal bias [s, s]: 0 on and below the diagonal, -1e9 above; built from
    # the runtime length so no [ctx, ctx] buffer has to be stored.
    b.scope = "/causal_mask"
    seq_1d = b.op("Unsqueeze", [seq_len, b.const([0], i64)])
    ones = b.op(
        "ConstantOfShape",
        [b.op("Concat", [seq_1d, seq_1d], axis=0)],
        value=numpy_helper.from_array(np.ones(1, dtype=f32)),
    )
    lower = b.op("Trilu", [ones], upper=0)
    causal = b.op("Mul", [b.op("Sub", [lower, b.const(1.0, f32)]), b.const(1e9, f32)])

    split_heads = b.const([0, 0, heads, head_dim], i64)
    merge_heads = b.const([0, 0, hidden], i64)
    qkv_split = b.const([hidden, hidden, hidden], i64)
    scale = b.const(math.sqrt(head_dim), f32)
    for layer in range(layers):
        p = f"transformer.h.{layer}"
        b.scope = f"/h.{layer}/attn"
        h = b.layer_norm(x, f"{p}.ln_1", hidden, eps)
        # GPT-2's Conv1D keeps Q, K and V in one [hidden, 3*hidden] weight.
        qkv = b.linear(h, f"{p}.attn.c_attn", hidden, 3 * hidden, 0.02)
        q, k, v = b.op("Split", [qkv, qkv_split], n_outputs=3, axis=-1)
        q = b.op("Transpose", [b.op("Reshape", [q, split_heads])], perm=[0, 2, 1, 3])
        k = b.op("Transpose", [b.op("Reshape", [k, split_heads])], perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [v, split_heads])], perm=[0, 2, 1, 3])
        scores = b.op("Div", [b.op("MatMul", [q, k]), scale])
        probs = b.op("Softmax", [b.op("Add", [scores, causal])], axis=-1)
        attn = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        attn = b.op("Reshape", [attn, merge_heads])
        attn = b.linear(attn, f"{p}.attn.c_proj", hidden, hidden, proj_std)
        x = b.op("Add", [x, attn])

        b.scope = f"/h.{layer}/mlp"
        h = b.layer_norm(x, f"{p}.ln_2", hidden, eps)
        h = b.linear(h, f"{p}.mlp.c_fc", hidden, ffn, 0.02)
        # gelu_new (tanh approximation), the activation GPT-2 was trained with.
        cube = b.op("Pow", [h, b.const(3.0, f32)])
        inner = b.op("Add", [h, b.op("Mul", [cube, b.const(0.044715, f32)])])
        inner = b.op("Mul", [inner, b.const(math.sqrt(2.0 / math.pi), f32)])
        gate = b.op("Add", [b.op("Tanh", [inner]), b.const(1.0, f32)])
        h = b.op("Mul", [b.op("Mul", [h, b.const(0.5, f32)]), gate])
        h = b.linear(h, f"{p}.mlp.c_proj", ffn, hidden, proj_std)
        x = b.op("Add", [x, h])

    b.scope = "/lm_head"
    x = b.layer_norm(x, "transformer.ln_f", hidden, eps)
    if tie_word_embeddings:
        flat = b.op("Reshape", [x, b.const([-1, hidden], i64)])
        logits = b.op("Gemm", [flat, wte], transB=1)
        out_shape = b.op("Concat", [ids_shape, b.const([vocab], i64)], axis=0)
        logits = b.op("Reshape", [logits, out_shape])
    else:
        lm_head = b.param("lm_head.weight", (hidden, vocab), 0.02)
        logits = b.op("MatMul", [x, lm_head])
    logits = b.rename_output(logits, "logits")

    inputs = {"input_ids": (np.dtype(i64), ("batch", "seq"))}
    outputs = {"logits": (np.dtype(f32), ("batch", "seq", vocab))}
    model = b.model("gpt2_like", inputs, outputs)
    path = _save(model, path, external_data)
    tied = "tied" if tie_word_embeddings else "untied"
    return _info(
        path,
        f"gpt2_like-{size}",
        b,
        inputs,
        outputs,
        f"GPT-2-like decoder: {layers} layers, hidden {hidden}, {heads} heads, "
        f"vocab {vocab}, context {ctx_len}, {tied} LM head",
        vocab_size=vocab,
        max_seq=ctx_len,
    )


# --------------------------------------------------------------------------- ResNet


def resnet_like(
    path: str | os.PathLike,
    *,
    size: str = "full",
    seed: int = 0,
    weights_as: str = "initializer",
    external_data: bool = False,
) -> ModelInfo:
    """Writes a ResNet-50-like CNN (v1.5, BatchNorm folded into conv biases).

    Full: torchvision ResNet-50 layout, bottleneck blocks [3, 4, 6, 3], widths
    64-512 (x4 expansion), 1000 classes (~25.5M params, ~102 MB fp32). Tiny:
    blocks [1, 1, 1, 1] at 1/8 width, still 224x224 input and 1000 classes.

    Args:
        path: Output ``.onnx`` path.
        size: ``"full"`` or ``"tiny"``.
        seed: Seed for the weights.
        weights_as: ``"initializer"`` or ``"constant"``.
        external_data: Store tensors in ``<stem>.data`` beside the model.

    Returns:
        ModelInfo with input ``pixel_values`` (float32 [batch, 3, 224, 224])
        and output ``logits`` (float32 [batch, 1000]).
    """
    _check_size(size)
    if size == "full":
        blocks, base = (3, 4, 6, 3), 64
    else:
        blocks, base = (1, 1, 1, 1), 8
    classes, expansion = 1000, 4
    b = _Builder(seed, weights_as)

    def conv(
        x: str, name: str, c_in: int, c_out: int, k: int, stride: int = 1, gain: float = 1.0
    ) -> str:
        # He init keeps activations O(1) through the ReLUs; `gain` < 1 on the
        # last conv of a residual branch stands in for BN's learned small gamma
        # so the residual sum does not double in variance per block.
        std = gain * math.sqrt(2.0 / (c_in * k * k))
        w = b.param(f"{name}.weight", (c_out, c_in, k, k), std)
        bias = b.param(f"{name}.bias", (c_out,), 0.01)
        pad = k // 2
        return b.op(
            "Conv", [x, w, bias], kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4
        )

    b.scope = "/stem"
    x = b.op("Relu", [conv("pixel_values", "conv1", 3, base, 7, stride=2)])
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = base
    for stage, n_blocks in enumerate(blocks):
        width = base * 2**stage
        for block in range(n_blocks):
            p = f"layer{stage + 1}.{block}"
            b.scope = f"/{p}"
            stride = 2 if stage > 0 and block == 0 else 1
            h = b.op("Relu", [conv(x, f"{p}.conv1", c_in, width, 1)])
            # v1.5: the stride sits on the 3x3 conv, not the first 1x1.
            h = b.op("Relu", [conv(h, f"{p}.conv2", width, width, 3, stride)])
            h = conv(h, f"{p}.conv3", width, width * expansion, 1, gain=0.2)
            if block == 0:
                x = conv(x, f"{p}.downsample.0", c_in, width * expansion, 1, stride)
            x = b.op("Relu", [b.op("Add", [h, x])])
            c_in = width * expansion

    b.scope = "/head"
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    fc_w = b.param("fc.weight", (classes, c_in), 1.0 / math.sqrt(c_in))
    fc_b = b.param("fc.bias", (classes,), 0.01)
    b.rename_output(b.op("Gemm", [x, fc_w, fc_b], transB=1), "logits")

    inputs = {"pixel_values": (np.dtype(np.float32), ("batch", 3, 224, 224))}
    outputs = {"logits": (np.dtype(np.float32), ("batch", classes))}
    model = b.model("resnet_like", inputs, outputs)
    path = _save(model, path, external_data)
    return _info(
        path,
        f"resnet_like-{size}",
        b,
        inputs,
        outputs,
        f"ResNet-50-like CNN: bottleneck blocks {list(blocks)}, base width {base}, "
        f"{classes} classes, BN folded",
    )


# --------------------------------------------------------------------------- MLP


def mlp(
    path: str | os.PathLike,
    *,
    size: str = "full",
    seed: int = 0,
    weights_as: str = "initializer",
    external_data: bool = False,
    target_bytes: int | None = None,
    width: int | None = None,
) -> ModelInfo:
    """Writes a plain MLP: N x (MatMul [D, D] + Add + Relu).

    The layer count is the one whose weight total is closest to
    ``target_bytes`` (at least one layer); ``ModelInfo.weights_bytes`` has the
    exact figure (100 MiB at D=1024 gives 25 layers, 100.1 MiB).

    Args:
        path: Output ``.onnx`` path.
        size: ``"full"`` or ``"tiny"``; sets the defaults below.
        seed: Seed for the weights.
        weights_as: ``"initializer"`` or ``"constant"``.
        external_data: Store tensors in ``<stem>.data`` beside the model.
        target_bytes: Desired weight total; default 100 MiB (full) or 1 MiB
            (tiny).
        width: D; default 1024 (full) or 256 (tiny).

    Returns:
        ModelInfo with input ``input`` and output ``output``, both float32
        [batch, D].
    """
    _check_size(size)
    if target_bytes is None:
        target_bytes = 100 * _MIB if size == "full" else _MIB
    if width is None:
        width = 1024 if size == "full" else 256
    layer_bytes = 4 * (width * width + width)
    n_layers = max(1, round(target_bytes / layer_bytes))
    b = _Builder(seed, weights_as)
    x = "input"
    for layer in range(n_layers):
        b.scope = f"/layers.{layer}"
        # He init: with 0.02 the activations would shrink ~5x per layer and hit
        # float32 denormals (very slow on x86) after ~25 layers.
        x = b.op("Relu", [b.linear(x, f"layers.{layer}", width, width, math.sqrt(2.0 / width))])
    x = b.rename_output(x, "output")

    inputs = {"input": (np.dtype(np.float32), ("batch", width))}
    outputs = {"output": (np.dtype(np.float32), ("batch", width))}
    model = b.model("mlp", inputs, outputs)
    path = _save(model, path, external_data)
    return _info(
        path,
        f"mlp-{size}",
        b,
        inputs,
        outputs,
        f"MLP: {n_layers} x (MatMul {width}x{width} + Add + Relu)",
    )


# --------------------------------------------------------------------------- activation-heavy


def unet_like(
    path: str | os.PathLike,
    *,
    size: str = "full",
    seed: int = 0,
    weights_as: str = "initializer",
    external_data: bool = False,
    image: int | None = None,
) -> ModelInfo:
    """Writes a U^2-Net-like segmenter: small weights, large spatial activations.

    Full: a 320x320 RGB input, an encoder of five levels (two 3x3 convolutions each, 32-64
    channels, max-pooling between levels), a decoder that upsamples (``Resize``), concatenates
    the encoder's skip and convolves twice, and side outputs at every decoder level fused by a
    1x1 convolution into one sigmoid mask, as U^2-Net's are (~0.6 MiB of weights, tens of MiB
    of activations a row). Tiny: 64x64 at 8-16 channels.

    Args:
        path: Output ``.onnx`` path.
        size: ``"full"`` or ``"tiny"``.
        seed: Seed for the weights.
        weights_as: ``"initializer"`` or ``"constant"``.
        external_data: Store tensors in ``<stem>.data`` beside the model.
        image: Height and width of the input (default 320 full, 64 tiny; a multiple of 16).

    Returns:
        ModelInfo with input ``image`` (float32 [batch, 3, H, W]) and output ``mask``
        (float32 [batch, 1, H, W]).
    """
    _check_size(size)
    widths = (32, 32, 64, 64, 64) if size == "full" else (8, 8, 16, 16, 16)
    side = image if image is not None else (320 if size == "full" else 64)
    if side % 16:
        raise ValueError(f"image must be a multiple of 16, not {side}")
    b = _Builder(seed, weights_as)

    def conv(x: str, name: str, c_in: int, c_out: int, k: int = 3) -> str:
        w = b.param(f"{name}.weight", (c_out, c_in, k, k), math.sqrt(2.0 / (c_in * k * k)))
        bias = b.param(f"{name}.bias", (c_out,), 0.01)
        return b.op("Relu", [b.op("Conv", [x, w, bias], kernel_shape=[k, k], pads=[k // 2] * 4)])

    x, c_in, skips = "image", 3, []
    for level, width in enumerate(widths):
        b.scope = f"/encoder.{level}"
        if level:
            x = b.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
        x = conv(
            conv(x, f"encoder.{level}.conv1", c_in, width), f"encoder.{level}.conv2", width, width
        )
        skips.append((x, width))
        c_in = width
    scales = b.const([1.0, 1.0, 2.0, 2.0], np.float32)
    sides = []
    for level in range(len(widths) - 2, -1, -1):
        b.scope = f"/decoder.{level}"
        skip, width = skips[level]
        up = b.op("Resize", [x, "", scales], mode="nearest")
        x = b.op("Concat", [up, skip], axis=1)
        x = conv(x, f"decoder.{level}.conv1", c_in + width, width)
        x = conv(x, f"decoder.{level}.conv2", width, width)
        c_in = width
        w = b.param(f"side.{level}.weight", (1, width, 3, 3), math.sqrt(1.0 / (9 * width)))
        s = b.op("Conv", [x, w], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        if level:
            factor = float(2**level)
            s = b.op(
                "Resize", [s, "", b.const([1.0, 1.0, factor, factor], np.float32)], mode="linear"
            )
        sides.append(s)
    b.scope = "/fuse"
    fused = b.op("Concat", sides, axis=1)
    w = b.param("fuse.weight", (1, len(sides), 1, 1), 1.0 / len(sides))
    b.op("Sigmoid", [b.op("Conv", [fused, w], kernel_shape=[1, 1])])
    b.rename_output(b.graph.node[-1].output[0], "mask")

    inputs = {"image": (np.dtype(np.float32), ("batch", 3, side, side))}
    outputs = {"mask": (np.dtype(np.float32), ("batch", 1, side, side))}
    model = b.model("unet_like", inputs, outputs)
    path = _save(model, path, external_data)
    return _info(
        path,
        f"unet_like-{size}",
        b,
        inputs,
        outputs,
        f"U^2-Net-like segmenter: {side}x{side}, {len(widths)} levels of {list(widths)} channels, "
        "skips concatenated, side outputs fused",
    )


def unet1d_like(
    path: str | os.PathLike,
    *,
    size: str = "full",
    seed: int = 0,
    weights_as: str = "initializer",
    external_data: bool = False,
    samples: int | None = None,
) -> ModelInfo:
    """Writes a 1-D U-Net with two inputs (a speech enhancer's mixture and reference).

    Full: two [batch, 1, 32000] signals concatenated, an encoder of strided 1-D convolutions
    (16-128 channels, kernel 9, each level half as long), a decoder of ``ConvTranspose`` that
    concatenates each level's skip, and a 1x1 convolution to one channel (~0.6 MiB of
    weights). Tiny: 4096 samples, 4-16 channels.

    Args:
        path: Output ``.onnx`` path.
        size: ``"full"`` or ``"tiny"``.
        seed: Seed for the weights.
        weights_as: ``"initializer"`` or ``"constant"``.
        external_data: Store tensors in ``<stem>.data`` beside the model.
        samples: Length of the signals (default 32000 full, 4096 tiny; a multiple of 16).

    Returns:
        ModelInfo with inputs ``mixture`` and ``reference`` (float32 [batch, 1, L]) and
        output ``enhanced`` (float32 [batch, 1, L]).
    """
    _check_size(size)
    widths = (16, 32, 64, 128) if size == "full" else (4, 8, 16, 16)
    length = samples if samples is not None else (32000 if size == "full" else 4096)
    if length % 16:
        raise ValueError(f"samples must be a multiple of 16, not {length}")
    b = _Builder(seed, weights_as)
    k = 9

    def conv(x: str, name: str, c_in: int, c_out: int, stride: int = 1) -> str:
        w = b.param(f"{name}.weight", (c_out, c_in, k), math.sqrt(2.0 / (c_in * k)))
        bias = b.param(f"{name}.bias", (c_out,), 0.01)
        pads = [k // 2, k // 2 - (1 if stride == 2 else 0)]
        return b.op(
            "LeakyRelu",
            [b.op("Conv", [x, w, bias], kernel_shape=[k], strides=[stride], pads=pads)],
            alpha=0.1,
        )

    b.scope = "/input"
    x = b.op("Concat", ["mixture", "reference"], axis=1)
    x, c_in, skips = conv(x, "input.conv", 2, widths[0]), widths[0], []
    for level, width in enumerate(widths[1:], start=1):
        b.scope = f"/encoder.{level}"
        skips.append((x, c_in))
        x = conv(
            conv(x, f"encoder.{level}.down", c_in, width, 2), f"encoder.{level}.conv", width, width
        )
        c_in = width
    for level in range(len(skips) - 1, -1, -1):
        b.scope = f"/decoder.{level}"
        skip, width = skips[level]
        w = b.param(f"decoder.{level}.up.weight", (c_in, width, 2), math.sqrt(1.0 / c_in))
        up = b.op("ConvTranspose", [x, w], kernel_shape=[2], strides=[2])
        x = conv(b.op("Concat", [up, skip], axis=1), f"decoder.{level}.conv", 2 * width, width)
        c_in = width
    b.scope = "/output"
    w = b.param("output.weight", (1, c_in, 1), math.sqrt(1.0 / c_in))
    b.op("Tanh", [b.op("Conv", [x, w], kernel_shape=[1])])
    b.rename_output(b.graph.node[-1].output[0], "enhanced")

    signal = (np.dtype(np.float32), ("batch", 1, length))
    inputs = {"mixture": signal, "reference": signal}
    outputs = {"enhanced": signal}
    model = b.model("unet1d_like", inputs, outputs)
    path = _save(model, path, external_data)
    return _info(
        path,
        f"unet1d_like-{size}",
        b,
        inputs,
        outputs,
        f"1-D U-Net, two inputs: {length} samples, {list(widths)} channels, skips concatenated",
    )


def gru_like(
    path: str | os.PathLike,
    *,
    size: str = "full",
    seed: int = 0,
    weights_as: str = "initializer",
    external_data: bool = False,
    frames: int | None = None,
) -> ModelInfo:
    """Writes a small GRU voice-activity detector with its state as input and output.

    Full: [batch, 64, 40] filterbank frames -> a 1-D convolution (64 channels) -> a GRU of 64
    units over the frames, started from ``state`` -> a linear layer and a sigmoid per frame
    (~0.1 MiB of weights). Tiny: 16 frames, 16 units.

    Args:
        path: Output ``.onnx`` path.
        size: ``"full"`` or ``"tiny"``.
        seed: Seed for the weights.
        weights_as: ``"initializer"`` or ``"constant"``.
        external_data: Store tensors in ``<stem>.data`` beside the model.
        frames: Frames per call (default 64 full, 16 tiny).

    Returns:
        ModelInfo with inputs ``features`` (float32 [batch, frames, 40]) and ``state``
        (float32 [1, batch, H]), outputs ``speech`` (float32 [batch, frames]) and
        ``next_state``.
    """
    _check_size(size)
    hidden = 64 if size == "full" else 16
    steps = frames if frames is not None else (64 if size == "full" else 16)
    bins = 40
    b = _Builder(seed, weights_as)
    b.scope = "/frontend"
    x = b.op("Transpose", ["features"], perm=[0, 2, 1])  # [batch, bins, frames]
    w = b.param("frontend.weight", (hidden, bins, 3), math.sqrt(2.0 / (bins * 3)))
    x = b.op("Relu", [b.op("Conv", [x, w], kernel_shape=[3], pads=[1, 1])])
    x = b.op("Transpose", [x], perm=[2, 0, 1])  # [frames, batch, hidden]
    b.scope = "/gru"
    std = 1.0 / math.sqrt(hidden)
    gw = b.param("gru.weight", (1, 3 * hidden, hidden), std)
    gr = b.param("gru.recurrence", (1, 3 * hidden, hidden), std)
    gb = b.param("gru.bias", (1, 6 * hidden), 0.01)
    y, _state = b.op(
        "GRU", [x, gw, gr, gb, "", "state"], n_outputs=2, hidden_size=hidden, linear_before_reset=1
    )
    b.graph.node[-1].output[1] = "next_state"
    b.scope = "/head"
    y = b.op("Transpose", [b.op("Squeeze", [y, b.const([1], np.int64)])], perm=[1, 0, 2])
    y = b.linear(y, "head", hidden, 1, std)
    b.op("Sigmoid", [b.op("Squeeze", [y, b.const([2], np.int64)])])
    b.rename_output(b.graph.node[-1].output[0], "speech")

    inputs = {
        "features": (np.dtype(np.float32), ("batch", steps, bins)),
        "state": (np.dtype(np.float32), (1, "batch", hidden)),
    }
    outputs = {
        "speech": (np.dtype(np.float32), ("batch", steps)),
        "next_state": (np.dtype(np.float32), (1, "batch", hidden)),
    }
    model = b.model("gru_like", inputs, outputs)
    path = _save(model, path, external_data)
    return _info(
        path, f"gru_like-{size}", b, inputs, outputs, f"GRU VAD: {steps} frames, {hidden} units"
    )


REGISTRY: dict[str, Callable[..., ModelInfo]] = {
    "bert": bert_like,
    "resnet": resnet_like,
    "gpt2": gpt2_like,
    "mlp": mlp,
    "unet": unet_like,
    "unet1d": unet1d_like,
    "gru": gru_like,
}


def sample_inputs(
    info: ModelInfo, *, batch: int = 1, seq: int = 16, seed: int = 0
) -> dict[str, np.ndarray]:
    """Makes valid feeds for a generated model.

    Token ids are uniform in ``[0, vocab_size)``, attention masks are all ones,
    float inputs are standard normal.

    Args:
        info: What a generator returned.
        batch: Value for the ``"batch"`` dimension.
        seq: Value for the ``"seq"`` dimension.
        seed: Seed for the random values.

    Returns:
        Input name -> array, ready for ``InferenceSession.run``.

    Raises:
        ValueError: If ``seq`` exceeds the model's ``max_seq`` or a symbolic
            dimension is unknown.
    """
    if info.max_seq is not None and seq > info.max_seq:
        raise ValueError(f"seq={seq} exceeds max_seq={info.max_seq} of {info.name}")
    rng = np.random.default_rng(seed)
    sizes = {"batch": batch, "seq": seq}
    feeds: dict[str, np.ndarray] = {}
    for name, (dtype, dims) in info.inputs.items():
        try:
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in dims)
        except KeyError as exc:
            raise ValueError(f"input {name} has unknown symbolic dimension {exc}") from None
        if np.issubdtype(dtype, np.integer):
            if name == "attention_mask":
                feeds[name] = np.ones(shape, dtype=dtype)
            else:
                high = info.vocab_size if info.vocab_size is not None else 2
                feeds[name] = rng.integers(0, high, size=shape, dtype=dtype)
        else:
            feeds[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
    return feeds


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints ``path<TAB>bytes (MiB)``.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        Process exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(REGISTRY))
    parser.add_argument("-o", "--output", required=True, help="destination .onnx path")
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights-as", choices=("initializer", "constant"), default="initializer")
    parser.add_argument(
        "--external-data", action="store_true", help="store weights in <stem>.data beside the model"
    )
    args = parser.parse_args(argv)
    info = REGISTRY[args.name](
        args.output,
        size=args.size,
        seed=args.seed,
        weights_as=args.weights_as,
        external_data=args.external_data,
    )
    print(f"{info.path}\t{info.weights_bytes} bytes ({info.weights_bytes / _MIB:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
