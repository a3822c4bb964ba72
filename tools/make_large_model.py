"""Writes an ONNX model with several GiB of weights, streamed to external data.

Models above protobuf's 2 GiB limit cannot be built in memory and saved with
``onnx.save_model``; this tool instead writes each weight straight into
``<stem>.data`` in small chunks and builds TensorProtos that only *point* at
the file (``location`` / ``offset`` / ``length``). Peak memory stays at one
16 MiB chunk whatever the model size.

Two graph shapes are offered:

* ``gather`` (default): ``output = sum_i Gather(W_i, input_ids)`` with
  ``W_i`` of shape [rows, 4096], like stacked embedding tables. Running it
  touches only a few rows, so inference is cheap and ORT does not prepack (copy)
  the weights: session memory is just the weights.
* ``matmul``: a chain of square ``MatMul`` on an input of shape [batch, D];
  every weight is read on each run and ORT's MatMul prepacking applies.

Command line::

    python tools/make_large_model.py OUT.onnx [--gib 2.5] [--tensor-mib 256]
        [--kind gather|matmul] [--seed N]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper

try:
    from tools.realistic_models import IR_VERSION, OPSET, ModelInfo
except ImportError:  # run as a script: tools/ itself is on sys.path
    from realistic_models import IR_VERSION, OPSET, ModelInfo  # type: ignore[no-redef]

__all__ = ["make_large_model", "main"]

_MIB = 1 << 20
_GIB = 1 << 30
_CHUNK_ELEMS = 4 * _MIB  # 16 MiB of float32 per generate-and-write step
# Tensor offsets are multiples of 64 KiB (the Windows mmap granularity, a
# multiple of the page size elsewhere) so a runtime can map each tensor
# directly from the file.
_ALIGN = 64 * 1024
_GATHER_WIDTH = 4096


def _external_tensor(
    name: str, dims: Sequence[int], location: str, offset: int, length: int
) -> TensorProto:
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = TensorProto.FLOAT
    tensor.dims.extend(dims)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key = key
        entry.value = value
    return tensor


def _write_random(
    f: BinaryIO, rng: np.random.Generator, n_elems: int, std: float, buf: np.ndarray
) -> None:
    """Streams ``n_elems`` float32 N(0, std**2) values to ``f`` chunk by chunk."""
    done = 0
    while done < n_elems:
        n = min(len(buf), n_elems - done)
        chunk = buf[:n]
        rng.standard_normal(n, dtype=np.float32, out=chunk)
        chunk *= np.float32(std)
        f.write(chunk.data)
        done += n


def make_large_model(
    path: str | os.PathLike,
    *,
    gib: float = 2.5,
    tensor_mib: int = 256,
    kind: str = "gather",
    seed: int = 0,
) -> ModelInfo:
    """Writes ``path`` and ``<stem>.data`` holding about ``gib`` GiB of weights.

    Args:
        path: Destination ``.onnx`` path; the data file goes beside it.
        gib: Total weight size in GiB. ``gather`` is exact up to one row
            (16 KiB); ``matmul`` rounds to a whole number of square tensors.
        tensor_mib: Size of each weight tensor in MiB (the last may be smaller).
        kind: ``"gather"`` or ``"matmul"`` (see the module docstring).
        seed: Seed for the weights; same arguments give byte-identical files.

    Returns:
        ModelInfo. ``gather``: input ``input_ids`` int64 [batch, seq] (ids below
        ``vocab_size``), output float32 [batch, seq, 4096]. ``matmul``: input
        ``input`` float32 [batch, D], output float32 [batch, D].

    Raises:
        ValueError: On a non-positive size or an unknown kind.
    """
    if gib <= 0 or tensor_mib <= 0:
        raise ValueError("gib and tensor_mib must be positive")
    if kind not in ("gather", "matmul"):
        raise ValueError(f"kind must be 'gather' or 'matmul', not {kind!r}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    location = Path(path).stem + ".data"
    total = int(gib * _GIB)
    tensor_bytes = tensor_mib * _MIB

    # Plan the tensor shapes first so the graph and the file agree.
    shapes: list[tuple[int, int]] = []
    if kind == "gather":
        row_bytes = 4 * _GATHER_WIDTH
        rows_left = max(1, total // row_bytes)
        rows_per_tensor = max(1, tensor_bytes // row_bytes)
        while rows_left > 0:
            rows = min(rows_per_tensor, rows_left)
            shapes.append((rows, _GATHER_WIDTH))
            rows_left -= rows
    else:
        dim = max(1, math.isqrt(tensor_bytes // 4))
        shapes = [(dim, dim)] * max(1, round(total / (4 * dim * dim)))

    rng = np.random.default_rng(seed)
    buf = np.empty(_CHUNK_ELEMS, dtype=np.float32)
    initializers: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    offset = 0
    # "wb" truncates: a stale data file must not survive with extra bytes.
    with open(os.path.join(directory, location), "wb") as f:
        for i, (rows, cols) in enumerate(shapes):
            pad = -offset % _ALIGN
            f.write(b"\0" * pad)
            offset += pad
            length = 4 * rows * cols
            # matmul: 1/sqrt(D) keeps activations O(1) down the chain; gather: embedding-like.
            std = 1.0 / math.sqrt(rows) if kind == "matmul" else 0.02
            _write_random(f, rng, rows * cols, std, buf)
            name = f"weight_{i}"
            initializers.append(_external_tensor(name, (rows, cols), location, offset, length))
            offset += length

    if kind == "gather":
        terms = [f"gathered_{i}" for i in range(len(shapes))]
        for i, term in enumerate(terms):
            nodes.append(helper.make_node("Gather", [f"weight_{i}", "input_ids"], [term], axis=0))
        acc = terms[0]
        for i, term in enumerate(terms[1:], start=1):
            out = "output" if i == len(terms) - 1 else f"sum_{i}"
            nodes.append(helper.make_node("Add", [acc, term], [out]))
            acc = out
        if len(terms) == 1:
            nodes.append(helper.make_node("Identity", [acc], ["output"]))
        in_name, in_dtype, in_shape = "input_ids", np.int64, ("batch", "seq")
        out_shape: tuple[int | str, ...] = ("batch", "seq", _GATHER_WIDTH)
        vocab: int | None = min(rows for rows, _ in shapes)
    else:
        acc = "input"
        for i in range(len(shapes)):
            out = "output" if i == len(shapes) - 1 else f"hidden_{i}"
            nodes.append(helper.make_node("MatMul", [acc, f"weight_{i}"], [out]))
            acc = out
        in_name, in_dtype, in_shape = "input", np.float32, ("batch", shapes[0][0])
        out_shape = ("batch", shapes[0][1])
        vocab = None

    graph = helper.make_graph(
        nodes,
        f"large_{kind}",
        [
            helper.make_tensor_value_info(
                in_name, helper.np_dtype_to_tensor_dtype(np.dtype(in_dtype)), list(in_shape)
            )
        ],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, list(out_shape))],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="sharedml.tools.make_large_model",
    )
    model.ir_version = IR_VERSION
    # No raw_data anywhere, so save_model writes only the small graph file.
    onnx.save_model(model, path)
    weights_bytes = sum(4 * r * c for r, c in shapes)
    return ModelInfo(
        path=path,
        name=f"large_{kind}",
        weights_bytes=weights_bytes,
        inputs={in_name: (np.dtype(in_dtype), in_shape)},
        description=f"{len(shapes)} external tensors, {kind} graph, "
        f"{weights_bytes / _GIB:.2f} GiB in {location}",
        outputs={"output": (np.dtype(np.float32), out_shape)},
        vocab_size=vocab,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints ``path<TAB>bytes (GiB)``.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        Process exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="destination .onnx path (weights go to <stem>.data)")
    parser.add_argument("--gib", type=float, default=2.5, help="total weight size (default 2.5)")
    parser.add_argument("--tensor-mib", type=int, default=256, help="size of each weight tensor")
    parser.add_argument("--kind", choices=("gather", "matmul"), default="gather")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = make_large_model(
        args.output, gib=args.gib, tensor_mib=args.tensor_mib, kind=args.kind, seed=args.seed
    )
    print(f"{info.path}\t{info.weights_bytes} bytes ({info.weights_bytes / _GIB:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
