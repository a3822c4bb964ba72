"""The plan: which tensors of a model move to the weights file, decided before any byte is written.

Every tensor of at least ``size_threshold_bytes`` moves, wherever it was in the source: an
initializer stored inline or in external data files, a ``Constant`` node (turned into an
initializer of the same graph, as ORT itself does at load), or either of those inside
``If``/``Loop``/``Scan`` bodies at any depth. The plan is data (:class:`WeightsPlan`), so that
tests can check it without touching disk, and one loop then writes it.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from pathlib import Path

from sharedml._errors import ExternalDataError, InvalidModelError
from sharedml.model._graph import (
    ExternalSlice,
    Placement,
    ResolvedFiles,
    is_external,
    iter_tensors,
    resolve_external,
    tensor_nbytes,
)
from sharedml.model._proto import ModelProto, TensorProto
from sharedml.prepared._format import check_alignment

__all__ = [
    "DEFAULT_SIZE_THRESHOLD_BYTES",
    "TensorSource",
    "WeightsPlan",
    "check_settings",
    "check_threshold",
    "plan_weights",
]

DEFAULT_SIZE_THRESHOLD_BYTES = 1024  # bytes: what onnx's own external-data helpers use
# Tensors under this many bytes always stay inline, whatever the threshold: shape inference at
# load must read small constant inputs (Reshape's shape, Slice's starts) from the graph, and ORT
# copies external tensors this small into the graph at load anyway.
_ALWAYS_INLINE_BYTES = 128


@dataclasses.dataclass
class TensorSource:
    """Where a tensor's bytes come from: a checked slice of a file, or bytes in the graph."""

    tensor: TensorProto
    nbytes: int
    piece: ExternalSlice | None = None

    @property
    def file(self) -> Path | None:
        """The external data file it is in; ``None`` for bytes in the graph."""
        return self.piece.file if self.piece is not None else None

    @property
    def offset(self) -> int:
        """Its offset in :attr:`file` (0 for bytes in the graph)."""
        return self.piece.offset if self.piece is not None else 0


@dataclasses.dataclass
class WeightsPlan:
    """What prepare will do to a model, computed from its protobuf before any I/O.

    Attributes:
        moving: The tensors that go to the weights file, in the order they are written.
        inline_tensors: Tensors left in the graph: initializers and ``Constant`` nodes below the
            threshold, strings.
        inline_bytes: Their data size.
        constants_converted: ``Constant`` nodes turned into initializers (already done to the
            model the plan was made from).
    """

    moving: list[TensorSource]
    inline_tensors: int
    inline_bytes: int
    constants_converted: int

    @property
    def moving_bytes(self) -> int:
        """Data bytes of the tensors that move (without alignment padding)."""
        return sum(s.nbytes for s in self.moving)


def _source_of(tensor: TensorProto, model_path: Path, files: ResolvedFiles) -> TensorSource | None:
    if is_external(tensor):
        piece = resolve_external(tensor, model_path, resolved_files=files)
        return TensorSource(tensor=tensor, nbytes=piece.length, piece=piece)
    expected = tensor_nbytes(tensor)
    if expected is None:
        return None
    name = tensor.name or "<unnamed>"
    if tensor.HasField("raw_data"):
        if len(tensor.raw_data) != expected:
            raise InvalidModelError(
                f"Tensor '{name}' in '{model_path}' holds {len(tensor.raw_data)} bytes but its "
                f"shape {list(tensor.dims)} needs {expected}."
            )
    else:
        # Values in typed fields (float_data, int32_data, ...): a handful of them may declare any
        # shape. Converting costs only what is really stored (numpy refuses the reshape before
        # anything of the declared size exists), and tells a corrupt tensor apart here rather
        # than in the middle of writing the weights file.
        try:
            from onnx import numpy_helper

            numpy_helper.to_array(tensor)
        except Exception as exc:
            raise InvalidModelError(
                f"Tensor '{name}' in '{model_path}' declares shape {list(tensor.dims)} "
                f"({expected} bytes) but its stored values do not fill it ({exc}). The model "
                "is corrupt; export it again."
            ) from None
    return TensorSource(tensor=tensor, nbytes=expected)


def _check_overlaps(sources: list[TensorSource], model_path: Path) -> None:
    """Refuse partially overlapping external ranges; identical ranges (tied weights) are fine."""
    by_file: dict[Path, list[tuple[int, int, str]]] = {}
    for src in sources:
        if src.file is not None and src.nbytes:
            by_file.setdefault(src.file, []).append(
                (src.offset, src.offset + src.nbytes, src.tensor.name)
            )
    for file, ranges in by_file.items():
        ranges.sort()
        for (a_start, a_end, a_name), (b_start, b_end, b_name) in itertools.pairwise(ranges):
            if b_start < a_end and (a_start, a_end) != (b_start, b_end):
                raise ExternalDataError(
                    f"Tensors '{a_name}' and '{b_name}' in '{model_path}' claim overlapping bytes "
                    f"of '{file}' ({a_start}..{a_end} and {b_start}..{b_end})."
                )


def plan_weights(model: ModelProto, model_path: Path, threshold: int) -> WeightsPlan:
    """Decide which tensors move; turn large ``Constant`` nodes into initializers on the way.

    Moves initializers and ``Constant`` values at any depth; other tensor attributes and sparse
    initializers stay in the graph (ORT reads them from there). ``model`` is modified: large
    Constant nodes become initializers of the same graph, named as their output, which is what
    ORT itself does when it loads the graph, so semantics are unchanged.

    Raises:
        ExternalDataError, UnsafePathError, InvalidModelError: as :func:`prepare`.
    """
    moving: list[TensorSource] = []
    inline_count = inline_bytes = converted = 0
    floor = max(threshold, _ALWAYS_INLINE_BYTES)
    files: ResolvedFiles = {}
    # Initializers that are not graph inputs need IR version 4; older models keep their Constants.
    may_convert = model.ir_version >= 4
    for ref in list(iter_tensors(model.graph)):
        tensor = ref.tensor
        if ref.placement is Placement.CONSTANT:
            assert ref.node is not None
            size = (
                resolve_external(tensor, model_path, resolved_files=files).length
                if is_external(tensor)
                else tensor_nbytes(tensor)
            )
            if not may_convert or len(ref.node.output) != 1 or size is None or size < floor:
                inline_count += 1  # stays a Constant node in the graph
                inline_bytes += size or 0
                continue
            tensor = ref.graph.initializer.add()
            tensor.CopyFrom(ref.tensor)
            tensor.name = ref.name
            ref.graph.node.remove(ref.node)
            converted += 1
        elif ref.placement is not Placement.INITIALIZER:
            continue
        src = _source_of(tensor, model_path, files)
        # External tensors always move, small or not: the prepared model must not point at
        # the source's files, which need not travel with it.
        if src is None or (src.file is None and src.nbytes < floor):
            inline_count += 1
            inline_bytes += src.nbytes if src is not None else 0
            continue
        moving.append(src)
    _check_overlaps(moving, model_path)
    return WeightsPlan(moving, inline_count, inline_bytes, converted)


def check_settings(size_threshold_bytes: int, alignment_bytes: int) -> None:
    """Refuse prepare settings out of range (``ValueError``)."""
    check_alignment(alignment_bytes)
    check_threshold(size_threshold_bytes)


def check_threshold(size_threshold_bytes: object) -> int:
    """``size_threshold_bytes`` as an int, or ``ValueError``: a whole number of bytes >= 0.

    A float (``1.5``, ``nan``) was accepted and made a cache key of its own; NaN compares
    false with every size, so it silently moved nothing.
    """
    try:
        value = operator.index(size_threshold_bytes)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if isinstance(size_threshold_bytes, bool) or value < 0:
        raise ValueError(
            "size_threshold_bytes must be a whole number of bytes >= 0, not "
            f"{size_threshold_bytes!r}."
        )
    return value
