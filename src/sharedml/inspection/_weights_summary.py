"""The static part of ``sharedml inspect``'s report: a model's weights, read without loading them.

How many bytes of weights, where they sit (initializers, Constant nodes, node attributes,
subgraphs, external files, sparse initializers), the largest tensors, and what ``prepare`` would
move into its weights file, from prepare's own plan.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from sharedml.model._dtypes import onnx_name
from sharedml.model._graph import (
    ExternalData,
    Placement,
    iter_attribute_weights,
    iter_tensors,
    tensor_nbytes,
)

__all__ = [
    "PLACEMENTS",
    "UNSHARED_PLACEMENTS",
    "PlacementSummary",
    "TensorInfo",
    "WeightsSummary",
    "summarize_weights",
]

_LARGEST_SHOWN = 5

# Weights prepare leaves in the graph, which every session therefore copies for itself.
UNSHARED_PLACEMENTS = ("node attributes", "sparse initializers")
# Where a tensor's bytes sit; exclusive, in the order reports list them.
PLACEMENTS = (
    "initializers",
    "Constant nodes",
    "node attributes",
    "subgraphs",
    "external files",
    "sparse initializers",
)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One weight of the model.

    Attributes:
        name: The tensor's name (a Constant node's output name).
        dtype: ONNX element type, lower case (``"float"``, ``"int64"``...).
        shape: Its dimensions.
        nbytes: Its data size in bytes.
        placement: One of :data:`PLACEMENTS`.
        file: The external data file, for tensors stored in one.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    placement: str
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class PlacementSummary:
    """The tensors of one placement: how many, how many bytes."""

    placement: str
    tensors: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class WeightsSummary:
    """The static part of the report: the model's weights, read without loading them.

    Attributes:
        total_bytes: Bytes of every weight (initializers, Constant nodes, subgraphs, external,
            node attributes: ``ai.onnx.ml`` parameters count, 4 bytes a float, 8 an int).
        tensors: How many tensors (and parameter attributes) that is.
        placements: Tensors and bytes per placement (only placements that occur).
        external_files: ``(file, bytes)`` of each external data file the model refers to.
        largest: The largest tensors, largest first.
        already_prepared: The model was written by ``sharedml.prepare``.
        prepare_moves_tensors: Tensors ``prepare`` would put in the weights file.
        prepare_moves_bytes: Their bytes.
        prepare_leaves_tensors: Tensors it would leave in the graph (small initializers and
            ``Constant`` nodes; node attributes are counted in ``unshared``).
        prepare_leaves_bytes: Their bytes.
        prepare_converts_constants: Constant nodes it would turn into initializers.
    """

    total_bytes: int
    tensors: int
    placements: tuple[PlacementSummary, ...]
    external_files: tuple[tuple[str, int], ...]
    largest: tuple[TensorInfo, ...]
    already_prepared: bool
    prepare_moves_tensors: int
    prepare_moves_bytes: int
    prepare_leaves_tensors: int
    prepare_leaves_bytes: int
    prepare_converts_constants: int

    @property
    def unshared(self) -> tuple[int, int]:
        """``(tensors, bytes)`` that stay in the graph where no route can share them.

        Node attributes (``ai.onnx.ml`` parameters, tensor attributes other than a
        ``Constant``'s) and sparse initializers: prepare cannot move them, so ORT copies them
        into every session.
        """
        chosen = [p for p in self.placements if p.placement in UNSHARED_PLACEMENTS]
        return sum(p.tensors for p in chosen), sum(p.nbytes for p in chosen)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "total_bytes": self.total_bytes,
            "tensors": self.tensors,
            "unshared": {"tensors": self.unshared[0], "bytes": self.unshared[1]},
            "placements": {
                p.placement: {"tensors": p.tensors, "bytes": p.nbytes} for p in self.placements
            },
            "external_files": [{"file": f, "bytes": b} for f, b in self.external_files],
            "largest": [t.to_dict() for t in self.largest],
            "prepare": {
                "already_prepared": self.already_prepared,
                "moves_tensors": self.prepare_moves_tensors,
                "moves_bytes": self.prepare_moves_bytes,
                "leaves_tensors": self.prepare_leaves_tensors,
                "leaves_bytes": self.prepare_leaves_bytes,
                "converts_constants": self.prepare_converts_constants,
            },
        }


def _dtype_name(data_type: int) -> str:
    try:
        return onnx_name(data_type)
    except ValueError:
        return f"type{data_type}"


def _tensor_bytes(tensor: Any) -> int:
    size = tensor_nbytes(tensor)
    if size is not None:
        return size
    if ExternalData.of(tensor) is None:  # inline strings: what they hold
        return sum(len(s) for s in tensor.string_data)
    return 0


_PLACEMENT_NAMES = {
    Placement.INITIALIZER: "initializers",
    Placement.CONSTANT: "Constant nodes",
    Placement.ATTRIBUTE: "node attributes",
    Placement.SPARSE: "sparse initializers",
}


def summarize_weights(model: Any, model_path: str | os.PathLike[str]) -> WeightsSummary:
    """The static part of the report for ``model`` (an ``onnx.ModelProto`` without data).

    Args:
        model: As :func:`sharedml.model._graph.load_graph` returns it. It is modified (prepare's
            plan converts large Constant nodes in place): pass a model you no longer need.
        model_path: The model's file, to resolve external data.

    Raises:
        ExternalDataError: external data that prepare would refuse (missing, short, unsafe).
    """
    from onnx import AttributeProto as onnx_attr

    from sharedml.prepared._format import read_manifest
    from sharedml.prepared._plan import DEFAULT_SIZE_THRESHOLD_BYTES, plan_weights

    tensors: list[TensorInfo] = []
    for ref in iter_tensors(model.graph):
        info = ExternalData.of(ref.tensor)
        if info is not None:
            placement = "external files"
        elif ref.depth > 0 and ref.placement is not Placement.SPARSE:
            placement = "subgraphs"
        else:
            placement = _PLACEMENT_NAMES[ref.placement]
        tensors.append(
            TensorInfo(
                name=ref.name or "<unnamed>",
                dtype=_dtype_name(ref.tensor.data_type),
                shape=tuple(int(d) for d in ref.tensor.dims),
                nbytes=_tensor_bytes(ref.tensor),
                placement=placement,
                file=info.location if info is not None else None,
            )
        )
    for node, attr, nbytes in iter_attribute_weights(model.graph):
        kind = {onnx_attr.FLOATS: "float", onnx_attr.INTS: "int64"}.get(attr.type, "string")
        count = len(attr.floats) or len(attr.ints) or len(attr.strings)
        tensors.append(
            TensorInfo(
                name=f"{node.name or node.op_type}.{attr.name}",
                dtype=kind,
                shape=(count,),
                nbytes=nbytes,
                placement="node attributes",
            )
        )
    placements = []
    for placement in PLACEMENTS:
        chosen = [t for t in tensors if t.placement == placement]
        if chosen:
            placements.append(
                PlacementSummary(placement, len(chosen), sum(t.nbytes for t in chosen))
            )
    files: dict[str, int] = {}
    for t in tensors:
        if t.file is not None:
            files[t.file] = files.get(t.file, 0) + t.nbytes
    largest = sorted(tensors, key=lambda t: t.nbytes, reverse=True)[:_LARGEST_SHOWN]

    already = read_manifest(model) is not None
    # prepare's own plan, so that "what prepare would move" cannot drift from prepare.
    plan = plan_weights(model, Path(model_path), DEFAULT_SIZE_THRESHOLD_BYTES)
    return WeightsSummary(
        total_bytes=sum(t.nbytes for t in tensors),
        tensors=len(tensors),
        placements=tuple(placements),
        external_files=tuple(sorted(files.items())),
        largest=tuple(largest),
        already_prepared=already,
        prepare_moves_tensors=len(plan.moving),
        prepare_moves_bytes=plan.moving_bytes,
        prepare_leaves_tensors=plan.inline_tensors,
        prepare_leaves_bytes=plan.inline_bytes,
        prepare_converts_constants=plan.constants_converted,
    )
