"""Compressed weights: MatMul and Gemm weights quantized to blocks of 8 or 4 bits, then prepared.

Weight-only quantization with ONNX Runtime's own tools: ``MatMulNBitsQuantizer`` turns every
``MatMul`` whose weight is a constant matrix into ORT's ``com.microsoft.MatMulNBits``, which
holds the weight as blocks of ``bits``-bit integers with a scale and zero point per block (along
K, per output column). Activations stay float and nothing is quantized across rows, so a
compressed model batches like its float original (``MatMulNBits`` is a row-wise rule of the
row-independence analysis). ``Gemm`` nodes with a constant weight are first rewritten to
``MatMul`` (+ ``Add`` of the bias), which is what the quantizer reads.

The compressed model is then prepared like any model (one aligned weights file), so every
session and process that asks for the same (model, format) maps the same file: the cache keys
the entry by the prepared float model's graph file (which records its weights' SHA-256) and the
format, builds it once and reuses it.

Formats (:class:`WeightsFormat`, one meaning per spelling):

- ``"float"``: the model as it is (no compression).
- ``"int8"``: 8-bit blocks of 128 values along K, asymmetric (uint8 + a float scale and a uint8
  zero point per block): about 0.27x the float matrices. Needs onnxruntime 1.22 or later (its
  quantizer writes 8 bits from then on, and its CPU kernels run them).
- ``"int4"``: 4-bit blocks of 32 values, asymmetric: about 0.16x the float matrices. Smaller
  blocks than ORT's default of 128 keep more accuracy for a few percent more bytes.

Embedding tables (a ``Gather`` on axis 0 of a constant float matrix, by indices the model is
fed) are compressed too, in 8-bit blocks of 128 along their width whatever the format, into
ORT's ``com.microsoft.GatherBlockQuantized``: for a small transformer they are most of the
weights (paraphrase-MiniLM-L3: 47 of its 66 MiB). The row-independence analysis treats that
lookup as it treats ``Gather`` (each row's ids pick their own table rows). Where the
installed onnxruntime cannot run such a table (measured once per process), tables stay float.

What is neither (convolutions, norms, biases) stays float.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sharedml._errors import CacheError, CompressError
from sharedml._host import _hashing, _platform
from sharedml.cache._entries import Built, ensure_entry, open_entry
from sharedml.cache._locks import lend_hold
from sharedml.cache._root import Cache, CacheDir
from sharedml.model._graph import iter_graphs, load_graph
from sharedml.model._proto import ModelProto
from sharedml.prepared._compress_passes import (
    MS_DOMAIN,
    GemmsToMatMuls,
    MatMulsToNBits,
    Pass,
    TablesToBlockQuantized,
    compressible,
    dequantized,
    quantize_tables,
    run_passes,
)
from sharedml.prepared._files import check_outputs, scratch_folder, source_files
from sharedml.prepared._format import read_manifest
from sharedml.prepared._plan import DEFAULT_SIZE_THRESHOLD_BYTES, check_threshold
from sharedml.prepared._prepare import (
    PrepareResult,
    output_paths,
    prepare,
    prepared_model_with_graph,
)
from sharedml.runtime import _quantization
from sharedml.runtime._quantization import BlockFormat

__all__ = [
    "CompressResult",
    "WeightsFormat",
    "compress",
    "compressed_model_for",
    "compression_unavailable",
]

_log = logging.getLogger("sharedml")

# Bump when what a compressed entry holds changes (block sizes, the Gemm rewrite, symmetry,
# embedding tables).
_KEY_VERSION = "2"
_PREPARED_NAME = "model.onnx"  # as in the models entries prepare builds
_SCRATCH_MODEL = "quantized.onnx"  # the quantizer's output, before it is prepared
_SCRATCH_DATA = "quantized.data"


class WeightsFormat(enum.Enum):
    """How a pool's MatMul and Gemm weights are stored: float, or blocks of 8 or 4 bits."""

    FLOAT = "float"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int | None:
        """Bits per quantized value (None for float)."""
        return {WeightsFormat.INT8: 8, WeightsFormat.INT4: 4}.get(self)

    @property
    def block_size(self) -> int:
        """Values along K that share one scale and zero point (0 for float)."""
        # int4: 32 as llama.cpp's Q4 formats use, for accuracy (ORT's default is 128); int8
        # keeps ORT's 128, where a block's rounding error is already small.
        return {WeightsFormat.INT8: 128, WeightsFormat.INT4: 32}.get(self, 0)

    @property
    def accuracy_level(self) -> int | None:
        """``MatMulNBits``'s ``accuracy_level``: what type its CPU kernel computes in.

        int8 computes in int8 (4): each row's activations are quantized on their own, block by
        block along K, so rows stay independent (a merged batch gave bitwise the solo rows).
        At the default (float compute) this AVX2 CPU's 8-bit kernel dequantized the weights
        into float scratch on every run: a process with 64 MiB of float matrices (17 MiB as
        int8) grew by 72 MiB, 24 MiB once glibc gave the freed heap back; in int8, 25 MiB
        either way. int4 keeps float compute: its int8-compute kernel gave merged rows 1.7%
        away from solo rows (another kernel for one row), float compute 5e-6.
        """
        return 4 if self is WeightsFormat.INT8 else None

    @classmethod
    def parse(cls, value: object) -> WeightsFormat:
        """The format named by ``value`` (a :class:`WeightsFormat` or its string).

        Raises:
            ValueError: an unknown name (the message lists the known ones).
        """
        if isinstance(value, WeightsFormat):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(f.value) for f in cls)
            raise ValueError(f"weights must be one of {names}, not {value!r}.") from None


def _blocks(fmt: WeightsFormat) -> BlockFormat:
    """``fmt`` as ORT's quantizer and block-quantized kernels take it (asymmetric blocks).

    Raises:
        ValueError: ``FLOAT``, which has no blocks.
    """
    if fmt.bits is None:
        raise ValueError("weights='float' is not stored in blocks")
    return BlockFormat(fmt.value, fmt.bits, fmt.block_size, fmt.accuracy_level, symmetric=False)


# Embedding tables are stored in 8-bit blocks whatever the matrices' format: a table's error
# goes straight into every token's state, unlike a matrix's, which sums out over K. On
# paraphrase-MiniLM-L3 (64 rows of 32 random token ids), int4 matrices kept sentence
# embeddings at cosine 0.974 or more to the float ones; int4 tables as well brought that to
# 0.949 (the file 10.7 MiB), 8-bit tables kept 0.974 (15.2 MiB). Float tables: 48.9 MiB.
_TABLES = WeightsFormat.INT8


@dataclasses.dataclass(frozen=True)
class CompressResult:
    """What :func:`compress` wrote.

    Attributes:
        model_path: The compressed, prepared graph.
        weights_path: Its weights file.
        weights: The format.
        matrices: How many MatMul/Gemm weights were quantized.
        float_bytes: Their bytes (and the tables') before, as float.
        compressed_bytes: Their bytes (and the tables') after (quantized values, scales and
            zero points).
        prepared: What prepare wrote for the compressed model.
        tables: How many embedding tables were quantized.
    """

    model_path: Path
    weights_path: Path
    weights: WeightsFormat
    matrices: int
    float_bytes: int
    compressed_bytes: int
    prepared: PrepareResult
    tables: int = 0


# --------------------------------------------------------------------------------------------
# What the installed onnxruntime can do (measured by sharedml.runtime._quantization)


@functools.cache
def compression_unavailable(weights: WeightsFormat) -> str | None:
    """Why the installed onnxruntime cannot make or run ``weights`` here; None if it can.

    Measured once per process and format: a tiny MatMul is quantized with ORT's own tool and
    run on the CPU provider, and its output compared with the float product (a kernel that
    loads but computes garbage is caught too).
    """
    if weights is WeightsFormat.FLOAT:
        return None
    return _quantization.matmul_nbits_unavailable(_blocks(weights))


@functools.cache
def tables_unavailable(weights: WeightsFormat) -> str | None:
    """Why the installed onnxruntime cannot run ``weights`` embedding tables; None if it can.

    Measured once per process and format: a small table with an odd number of blocks per row
    is quantized as :func:`~sharedml.prepared._compress_passes.quantize_tables` does and
    looked up on the CPU provider; the rows must equal the table's dequantized rows exactly.
    """
    if weights is WeightsFormat.FLOAT:
        return None
    blocks = _blocks(weights)
    return _quantization.gather_block_quantized_unavailable(
        blocks,
        quantize=lambda model: quantize_tables(model, blocks),
        dequantize=lambda table: dequantized(table, blocks),
    )


# --------------------------------------------------------------------------------------------
# The rewrite (passes: sharedml.prepared._compress_passes), and what it wrote


def _refuse_if_nothing(model_path: Path, source: object, graph: ModelProto | None) -> None:
    if not compressible(graph if graph is not None else load_graph(model_path)):
        raise CompressError(
            f"The model '{source}' has no MatMul or Gemm with a constant float weight matrix, "
            "so there is nothing to compress (convolutions and norms stay float): "
            "use weights='float'."
        )


def _passes(fmt: WeightsFormat) -> list[Pass]:
    """The rewrites that compress a model to ``fmt``, in the order they apply.

    Embedding tables go in :data:`_TABLES` whatever ``fmt``, and only where this onnxruntime
    runs them (:func:`tables_unavailable`).
    """
    passes: list[Pass] = [GemmsToMatMuls(), MatMulsToNBits(_blocks(fmt))]
    if tables_unavailable(_TABLES) is None:
        passes.append(TablesToBlockQuantized(_blocks(_TABLES)))
    return passes


def _quantize(model: Any, fmt: WeightsFormat) -> tuple[Any, int]:
    """Compress ``model``'s MatMul and Gemm weights, and its embedding tables (:func:`_passes`).

    Returns:
        The compressed model, and the float bytes replaced (0 where no matrix was quantized).
    """
    before = {n.name: n for g in _graphs(model.graph) for n in g.initializer}
    model = run_passes(model, _passes(fmt))
    quantized = any(n.op_type == "MatMulNBits" for g in _graphs(model.graph) for n in g.node)
    after = {n.name for g in _graphs(model.graph) for n in g.initializer}
    float_bytes = sum(
        len(t.raw_data) or _tensor_bytes(t) for name, t in before.items() if name not in after
    )
    return model, float_bytes if quantized else 0


def _graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every subgraph (``If``/``Loop``/``Scan`` bodies) at any depth."""
    return (g for g, _ in iter_graphs(graph))


def _nbits_bytes(model: Any) -> int:
    """Bytes of each ``MatMulNBits`` weight and ``GatherBlockQuantized`` table, quantized.

    The packed values, scales and zero points, each initializer once.
    """
    total = 0
    for graph in _graphs(model.graph):
        sizes = {t.name: len(t.raw_data) or _tensor_bytes(t) for t in graph.initializer}
        counted: set[str] = set()
        for node in graph.node:
            if node.domain != MS_DOMAIN:
                continue
            if node.op_type == "MatMulNBits":
                names = node.input[1:4]
            elif node.op_type == "GatherBlockQuantized":
                names = [node.input[0], *node.input[2:4]]
            else:
                continue
            for name in names:
                if name and name not in counted:
                    counted.add(name)
                    total += sizes.get(name, 0)
    return total


def _tensor_bytes(tensor: Any) -> int:
    from onnx import numpy_helper

    return int(numpy_helper.to_array(tensor).nbytes)


# --------------------------------------------------------------------------------------------
# Writing a compressed, prepared model


def _write(float_path: Path, dst: Path, fmt: WeightsFormat, scratch: Path) -> CompressResult:
    """Quantize the prepared float model ``float_path`` and prepare the result at ``dst``.

    The quantizer's output goes to ``scratch`` (a folder) first, as a model with external data
    (so that any size can be written), and is removed once prepared.
    """
    import onnx

    why = compression_unavailable(fmt)
    if why is not None:
        raise CompressError(f"Cannot compress '{float_path}' to {fmt.value}: {why.rstrip('.')}.")
    model = onnx.load(str(float_path))  # a prepared model: its weights file, read whole
    quantized, float_bytes = _quantize(model, fmt)
    matrices = sum(
        1 for g in _graphs(quantized.graph) for n in g.node if n.op_type == "MatMulNBits"
    )
    tables = len(
        {
            n.input[0]
            for g in _graphs(quantized.graph)
            for n in g.node
            if n.op_type == "GatherBlockQuantized"
        }
    )
    compressed_bytes = _nbits_bytes(quantized)
    source, data = scratch / _SCRATCH_MODEL, scratch / _SCRATCH_DATA
    try:
        onnx.save_model(
            quantized,
            str(source),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=DEFAULT_SIZE_THRESHOLD_BYTES,
        )
        del model, quantized
        prepared = prepare(source, dst)
    finally:
        for leftover in (source, data):
            with contextlib.suppress(OSError):
                leftover.unlink()
        # The float model was read and parsed whole: glibc keeps those pages unless trimmed.
        _platform.release_freed_heap()
    return CompressResult(
        model_path=prepared.model_path,
        weights_path=prepared.weights_path,
        weights=fmt,
        matrices=matrices,
        float_bytes=float_bytes,
        compressed_bytes=compressed_bytes,
        prepared=prepared,
        tables=tables,
    )


def compress(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    weights: WeightsFormat | str = WeightsFormat.INT4,
) -> CompressResult:
    """Write a compressed, prepared copy of ``src``: its MatMul/Gemm weights in 8- or 4-bit blocks.

    The source is prepared first (into a temporary folder: prepare's checks of external data
    apply), its MatMul and Gemm weights are quantized with onnxruntime's
    ``MatMulNBitsQuantizer``, and the result is prepared at ``dst`` (graph + weights file, as
    :func:`sharedml.prepare` writes them). A pool given ``dst`` maps it like any prepared model.

    Args:
        src: Any ONNX model.
        dst: The graph file to write (an existing folder: ``<dst>/<src stem>.onnx``); its
            weights go to ``<dst stem>.weights`` beside it. Neither may be, or be another name
            for, ``src`` or one of its data files.
        weights: ``"int8"`` or ``"int4"`` (see :class:`WeightsFormat`).

    Returns:
        What was written, with the bytes of the matrices before and after.

    Raises:
        ValueError: an unknown ``weights``, or ``"float"`` (nothing to compress to).
        CompressError: the model has no MatMul/Gemm weight to compress, or the installed
            onnxruntime cannot write or run the format.
        PrepareError: ``dst`` or its weights file is (or aliases) a source file, or is not a
            regular file: refused before any work.
        ModelError, PrepareError: from :func:`sharedml.prepare`.

    Thread safety: safe to call concurrently (each call has its own temporary folder).
    """
    fmt = WeightsFormat.parse(weights)
    if fmt is WeightsFormat.FLOAT:
        raise ValueError("compress() needs weights='int8' or 'int4'; for float use prepare().")
    src_path = Path(src)
    dst_path, weights_path = output_paths(src_path, dst)
    # Before any work: the last step prepares the quantized scratch copy at dst, and would
    # replace the source there (compress(m, m)) without this.
    check_outputs(
        (dst_path, weights_path),
        source_files(src_path, load_graph(src_path).graph),
        writer="compress",
        fix="write the compressed model to another path",
    )
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    with scratch_folder(dst_path.parent, "compress") as scratch:
        float_path = prepare(src, scratch / "float.onnx").model_path
        _refuse_if_nothing(float_path, src, None)
        return _write(float_path, dst_path, fmt, scratch)


def _entry_key(float_path: Path, fmt: WeightsFormat) -> str:
    """The ``models`` entry key of ``float_path`` compressed to ``fmt``.

    The prepared graph records its weights file's SHA-256 and size, so a hash of the graph
    covers every byte of the model; the prefix keeps these keys apart from prepare's own.
    """
    digest = _hashing.sha256_file(float_path)
    settings = f"{fmt.value}:{fmt.block_size}:{fmt.accuracy_level}"
    text = f"sharedml-compressed:{_KEY_VERSION}:{settings}:{digest}"
    return hashlib.sha256(text.encode()).hexdigest()


def compressed_model_for(
    model_path: str | os.PathLike[str],
    *,
    weights: WeightsFormat | str,
    cache_dir: CacheDir = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    verify: bool = True,
    source: str | os.PathLike[str] | None = None,
    graph: ModelProto | None = None,
) -> Path:
    """A prepared, compressed copy of ``model_path`` in the cache, built once per model and format.

    The float model is prepared first (:func:`~sharedml.prepared._prepare.prepared_model_for`;
    a prepared model is used as it is), then compressed into a ``models`` entry keyed by that
    prepared graph and the format, which every later pool and process reuses and maps.

    Args:
        model_path: Any ONNX model.
        weights: ``"int8"`` or ``"int4"`` (``"float"`` returns the prepared float model).
        cache_dir: The cache: a path, a :class:`sharedml.cache.Cache`, or None for
            :func:`sharedml.cache_dir`.
        size_threshold_bytes: Passed to prepare for the float model.
        verify: Check the entry's files against their recorded SHA-256 (as prepare's entries).
        source: What messages and the entry's record call the model (default: ``model_path``;
            the route planner passes the caller's model when ``model_path`` is its prepared
            copy).
        graph: ``model_path``'s graph where the caller parsed it already (the route planner's
            prepared float model), so that it is not parsed again.

    Returns:
        ``<cache>/models/<key>/model.onnx``.

    Raises:
        ValueError: an unknown ``weights``.
        CompressError: nothing to compress, or the installed onnxruntime cannot make the format.
        ModelError, CacheError: as :func:`~sharedml.prepared._prepare.prepared_model_for`.

    Thread and process safety: as ``prepared_model_for``: every caller gets a complete entry;
    two processes building at once both quantize, and the first to publish wins.
    """
    fmt = WeightsFormat.parse(weights)
    named = source if source is not None else model_path
    cache = Cache.at(cache_dir)  # resolved once, for every step below
    size_threshold_bytes = check_threshold(size_threshold_bytes)
    float_graph: ModelProto | None
    if graph is not None and read_manifest(graph) is not None:
        float_path, float_graph = Path(model_path), graph  # prepared already: as it is
    else:
        float_path, float_graph = prepared_model_with_graph(
            model_path, cache_dir=cache, size_threshold_bytes=size_threshold_bytes, verify=verify
        )
    if fmt is WeightsFormat.FLOAT:
        return float_path
    key = _entry_key(float_path, fmt)
    checked: bool | tuple[str, ...] = True if verify else (_PREPARED_NAME,)
    with contextlib.suppress(CacheError):  # a damaged entry: ensure_entry below rebuilds it
        entry = open_entry("models", key, cache=cache, verify=checked)
        if entry is not None:
            # Built before: no quantizer import and no probe here. Both cost a process about
            # 50 MiB (onnx-ir, sympy), more than a compressed model saves on small weights.
            lend_hold(entry)
            return entry.file(_PREPARED_NAME)
    # Not built yet: only now is the float graph read for what it holds (an entry exists only
    # for a model that had something to compress).
    _refuse_if_nothing(float_path, named, float_graph)
    why = compression_unavailable(fmt)
    if why is not None:
        raise CompressError(f"Cannot compress '{named}' to {fmt.value}: {why.rstrip('.')}.")

    def build(folder: Path) -> Built:
        result = _write(float_path, folder / _PREPARED_NAME, fmt, folder)
        _log.info(
            "sharedml: compressed %d matrices of '%s' to %s: %d -> %d bytes",
            result.matrices,
            named,
            fmt.value,
            result.float_bytes,
            result.compressed_bytes,
        )
        return Built(
            meta={
                # "<model bytes>" stays as it is: a model given as bytes has no path
                "source": str(named) if str(named).startswith("<") else str(Path(named).absolute()),
                "weights": fmt.value,
                "float_model": str(float_path),
                "matrices": result.matrices,
                "float_bytes": result.float_bytes,
                "compressed_bytes": result.compressed_bytes,
                "tensors_moved": result.prepared.tensors_moved,
                "bytes": result.prepared.bytes_moved,
            },
            sha256={result.weights_path.name: result.prepared.manifest.sha256},
        )

    entry = ensure_entry("models", key, build, cache=cache, verify=checked)
    lend_hold(entry)  # as prepared_model_for: held until the caller maps it
    return entry.file(_PREPARED_NAME)
