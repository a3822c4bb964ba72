"""Deterministic generators of model *families*: several graphs over the same tensors.

Nothing is downloaded; the same arguments always give byte-identical files.

* :func:`decoder_pair`: a GPT-2-like ``decoder_model.onnx`` (the prompt: ``input_ids`` ->
  ``logits`` + ``present.*``) and ``decoder_with_past_model.onnx`` (one token and the
  ``past.*`` keys/values -> ``logits`` + ``present.*``), as Optimum exports them: one set of
  weights in two graphs. The second graph names its tensors differently (``transformer.``
  prefix), so sharing them can only come from their content.
* :func:`encoder_heads`: one encoder exported once per task head (sequence classification,
  token classification): the encoder's tensors twice, a small head each.
* :func:`renamed_variant`: any model's tensors under other names, plus one extra
  ``MatMul`` layer on its first output (a re-export with one layer more).

Command line::

    python tools/families.py decoder-pair OUT_DIR [--layers N --width D --vocab V]
    python tools/families.py encoder-heads OUT_DIR
    python tools/families.py variant SRC.onnx DST.onnx [--extra-bytes N]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

if __package__ in (None, ""):  # run as a script: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.realistic_models import _Builder

__all__ = ["decoder_pair", "encoder_heads", "renamed_variant"]

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)


def _gpt2(
    b: _Builder, *, with_past: bool, layers: int, width: int, heads: int, vocab: int, prefix: str
) -> None:
    """GPT-2's block structure; with_past: one new token attends to past keys and values."""
    head_dim = width // heads
    wte = b.param(f"{prefix}wte.weight", (vocab, width), 0.02)
    wpe = b.param(f"{prefix}wpe.weight", (64, width), 0.01)
    ids = "input_ids"
    if with_past:
        # The new token's position is the past length.
        past_len = b.op("Shape", ["past.0.key"], start=2, end=3)
        positions = b.op("Unsqueeze", [past_len, b.const([0], np.int64)])
    else:
        seq = b.op("Shape", [ids], start=1, end=2)
        positions = b.op(
            "Unsqueeze",
            [
                b.op("Range", [b.const(0, np.int64), b.op("Squeeze", [seq]), b.const(1, np.int64)]),
                b.const([0], np.int64),
            ],
        )
    x = b.op("Add", [b.op("Gather", [wte, ids]), b.op("Gather", [wpe, positions])])
    split_shape = b.const([0, 0, heads, head_dim], np.int64)
    merge_shape = b.const([0, 0, width], np.int64)
    scale = b.const(1.0 / math.sqrt(head_dim), np.float32)
    for layer in range(layers):
        p = f"{prefix}h.{layer}"
        h = b.layer_norm(x, f"{p}.ln_1", width, 1e-5)
        qkv = b.linear(h, f"{p}.attn.c_attn", width, 3 * width, 0.02)
        q, k, v = b.op("Split", [qkv], n_outputs=3, axis=-1)
        q, k, v = (
            b.op("Transpose", [b.op("Reshape", [t, split_shape])], perm=[0, 2, 1, 3])
            for t in (q, k, v)
        )
        if with_past:
            k = b.op("Concat", [f"past.{layer}.key", k], axis=2)
            v = b.op("Concat", [f"past.{layer}.value", v], axis=2)
        b.graph.node.append(helper.make_node("Identity", [k], [f"present.{layer}.key"]))
        b.graph.node.append(helper.make_node("Identity", [v], [f"present.{layer}.value"]))
        scores = b.op(
            "Mul", [b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])]), scale]
        )
        if not with_past:  # causal mask over the prompt; one new token sees everything
            square = b.op("Concat", [seq, seq], axis=0)
            ones = b.op(
                "ConstantOfShape",
                [square],
                value=helper.make_tensor("", TensorProto.BOOL, [1], [1]),
            )
            scores = b.op(
                "Where",
                [b.op("Trilu", [ones], upper=0), scores, b.const(-1e9, np.float32)],
            )
        attn = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])
        attn = b.op("Reshape", [b.op("Transpose", [attn], perm=[0, 2, 1, 3]), merge_shape])
        x = b.op("Add", [x, b.linear(attn, f"{p}.attn.c_proj", width, width, 0.02)])
        h = b.layer_norm(x, f"{p}.ln_2", width, 1e-5)
        h = b.op(
            "Relu",
            [  # GELU is opset 20; these graphs pin opset 17
                b.linear(h, f"{p}.mlp.c_fc", width, 4 * width, 0.02)
            ],
        )
        x = b.op("Add", [x, b.linear(h, f"{p}.mlp.c_proj", 4 * width, width, 0.02)])
    x = b.layer_norm(x, f"{prefix}ln_f", width, 1e-5)
    # GPT-2 ties the LM head to wte; exporters fold the Transpose into an initializer of its
    # own (a Transpose left in the graph would be folded by ORT in every raw-route session).
    table = next(t for t in b.graph.initializer if t.name == wte)
    head = np.frombuffer(table.raw_data, np.float32).reshape(vocab, width).T
    lm_head = b._store(f"{prefix}lm_head.weight", np.ascontiguousarray(head))
    b.graph.node.append(helper.make_node("MatMul", [x, lm_head], ["logits"]))


def decoder_pair(
    folder: str | os.PathLike[str],
    *,
    layers: int = 2,
    width: int = 128,
    heads: int = 4,
    vocab: int = 512,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``decoder_model.onnx`` and ``decoder_with_past_model.onnx`` into ``folder``.

    Both hold the same weights (same seed, same draw order), under different names.

    Returns:
        The two paths: (decoder, decoder with past).
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = width // heads
    paths = []
    for with_past, name, prefix in (
        (False, "decoder_model.onnx", ""),
        (True, "decoder_with_past_model.onnx", "transformer."),
    ):
        b = _Builder(seed, "initializer")
        _gpt2(
            b,
            with_past=with_past,
            layers=layers,
            width=width,
            heads=heads,
            vocab=vocab,
            prefix=prefix,
        )
        seq = 1 if with_past else "seq"
        inputs: dict[str, tuple[np.dtype, tuple[int | str, ...]]] = {
            "input_ids": (_I64, ("batch", seq))
        }
        outputs: dict[str, tuple[np.dtype, tuple[int | str, ...]]] = {
            "logits": (_F32, ("batch", seq, vocab))
        }
        for layer in range(layers):
            for kind in ("key", "value"):
                if with_past:
                    inputs[f"past.{layer}.{kind}"] = (_F32, ("batch", heads, "past", head_dim))
                outputs[f"present.{layer}.{kind}"] = (_F32, ("batch", heads, "total", head_dim))
        model = b.model("gpt2-decoder" + ("-with-past" if with_past else ""), inputs, outputs)
        path = out / name
        onnx.save_model(model, path)
        paths.append(path)
    return paths[0], paths[1]


def encoder_heads(
    folder: str | os.PathLike[str],
    *,
    layers: int = 2,
    width: int = 128,
    vocab: int = 512,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``encoder_classify.onnx`` and ``encoder_tokens.onnx``: one encoder, two heads.

    Returns:
        The two paths: (sequence classification, token classification).
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for head, name, classes in (
        ("classify", "encoder_classify.onnx", 3),
        ("tokens", "encoder_tokens.onnx", 9),
    ):
        b = _Builder(seed, "initializer")
        x = b.op("Gather", [b.param("embeddings.word.weight", (vocab, width), 0.02), "input_ids"])
        for layer in range(layers):
            h = b.linear(x, f"encoder.layer.{layer}.ffn.in", width, 4 * width, 0.02)
            h = b.linear(
                b.op("Relu", [h]), f"encoder.layer.{layer}.ffn.out", 4 * width, width, 0.02
            )
            x = b.layer_norm(b.op("Add", [x, h]), f"encoder.layer.{layer}.norm", width, 1e-12)
        # The heads draw from their own generator: the encoder's weights stay identical.
        b._rng = np.random.default_rng(seed + 1000 + classes)
        if head == "classify":
            x = b.op("ReduceMean", [x], axes=[1], keepdims=0)
            out_shape: tuple[int | str, ...] = ("batch", classes)
        else:
            out_shape = ("batch", "seq", classes)
        logits = b.linear(x, f"{head}.head", width, classes, 0.02)
        b.rename_output(logits, "logits")
        model = b.model(
            f"encoder-{head}",
            {"input_ids": (_I64, ("batch", "seq"))},
            {"logits": (_F32, out_shape)},
        )
        path = out / name
        onnx.save_model(model, path)
        paths.append(path)
    return paths[0], paths[1]


def renamed_variant(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    extra_bytes: int = 16 * 2**20,
    seed: int = 7,
) -> Path:
    """Write ``src`` with every initializer renamed (``variant.`` prefix) and one layer more.

    The extra layer is a float32 ``MatMul`` ``[D, D']`` on the first output (``D`` its last
    dimension), ``D' = extra_bytes / 4 / D``: the output becomes ``[..., D']``.

    Returns:
        ``dst``.
    """
    model = onnx.load(os.fspath(src))
    graph = model.graph
    renames = {t.name: f"variant.{t.name}" for t in graph.initializer}
    for tensor in graph.initializer:
        tensor.name = renames[tensor.name]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    out = graph.output[0]
    dims = out.type.tensor_type.shape.dim
    width = dims[-1].dim_value
    if width <= 0:
        raise ValueError(f"The first output of '{src}' needs a fixed last dimension.")
    cols = max(1, extra_bytes // 4 // width)
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((width, cols), dtype=np.float32) / np.float32(math.sqrt(width))
    extra = onnx.numpy_helper.from_array(weight, "variant.extra.weight")
    graph.initializer.append(extra)
    hidden = f"{out.name}.before_extra"
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == out.name:
                node.output[i] = hidden
    graph.node.append(helper.make_node("MatMul", [hidden, extra.name], [out.name]))
    dims[-1].dim_value = cols
    path = Path(dst)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("decoder-pair")
    p.add_argument("folder")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p = sub.add_parser("encoder-heads")
    p.add_argument("folder")
    p = sub.add_parser("variant")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--extra-bytes", type=int, default=16 * 2**20)
    args = parser.parse_args(argv)
    if args.what == "decoder-pair":
        written: Sequence[Path] = decoder_pair(
            args.folder, layers=args.layers, width=args.width, vocab=args.vocab
        )
    elif args.what == "encoder-heads":
        written = encoder_heads(args.folder)
    else:
        written = [renamed_variant(args.src, args.dst, extra_bytes=args.extra_bytes)]
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
