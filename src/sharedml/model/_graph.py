"""ONNX graphs and their tensors: the one walk over every tensor, the one parse of external data.

Every module that visits a model's tensors (prepare, the cache key, the prepacked route, inspect)
uses :func:`iter_tensors`, and every module that reads a tensor's ``external_data`` entries
uses :class:`ExternalData` (and :func:`resolve_external` to check it against the file system),
so that they agree on what a model holds. ``onnx``'s ``external_data_helper`` has the same
split (``_get_all_tensors``, ``ExternalDataInfo``); it is not used directly because it follows
symlinks and does not check locations against the model's folder.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from sharedml._errors import (
    ExternalDataError,
    InvalidModelError,
    ModelNotFoundError,
    UnsafePathError,
)
from sharedml._host import _files
from sharedml.model._dtypes import np_dtype
from sharedml.model._proto import (
    AttributeProto,
    GraphProto,
    ModelProto,
    NodeProto,
    TensorProto,
    parse_model,
)

__all__ = [
    "ExternalData",
    "ExternalSlice",
    "Placement",
    "ResolvedFiles",
    "TensorRef",
    "constant_value",
    "external_locations",
    "inline_bytes",
    "is_external",
    "iter_attribute_weights",
    "iter_graphs",
    "iter_tensors",
    "load_graph",
    "read_model",
    "resolve_external",
    "set_external",
    "tensor_nbytes",
]

_DEFAULT_DOMAINS = ("", "ai.onnx")


def load_graph(path: str | os.PathLike[str]) -> ModelProto:
    """Load a model's protobuf without any external data.

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        InvalidModelError: ``path`` is not a readable ONNX model.
    """
    return read_model(path)[0]


def read_model(path: str | os.PathLike[str]) -> tuple[ModelProto, bytes]:
    """A model's protobuf (external data not loaded) and the very bytes it was parsed from.

    One read serves both, so that whoever hashes the bytes hashes what was parsed (prepare keys
    the cache by what it read: :class:`sharedml.prepared._prepare.PrepareResult`'s
    ``source_sha256``).

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        InvalidModelError: ``path`` is not a regular file, cannot be read, or is not ONNX.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelNotFoundError(f"Model file '{path}' does not exist.") from None
    except OSError as exc:
        raise InvalidModelError(f"'{path}' cannot be read ({exc.strerror or exc}).") from None
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read forever
        raise InvalidModelError(
            f"'{path}' is not a file: it is {_files.file_kind(st.st_mode)}. Pass an .onnx file."
        )
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise InvalidModelError(f"'{path}' cannot be read ({exc.strerror or exc}).") from None
    try:
        model = parse_model(data)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning, ...: all "not ONNX"
        raise InvalidModelError(f"'{path}' is not a valid ONNX model: {exc}") from None
    if not model.HasField("graph"):
        raise InvalidModelError(f"'{path}' is not a valid ONNX model: it has no graph.")
    return model, data


class Placement(enum.Enum):
    """Where a tensor sits in a graph."""

    INITIALIZER = "initializer"
    CONSTANT = "Constant node"
    """The ``value`` of a ``Constant`` node: ORT turns it into an initializer at load."""
    ATTRIBUTE = "node attribute"
    """A TENSOR or TENSORS attribute of any other node (``ConstantOfShape``'s ``value``...)."""
    SPARSE = "sparse initializer"


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """One tensor of a model, and where it sits.

    Attributes:
        tensor: The protobuf (mutable: prepare rewrites it in place).
        name: The name the graph knows it by: an initializer's name, a Constant's output.
        placement: Where it sits.
        graph: The graph that holds it.
        depth: 0 in the main graph, 1 in a subgraph of it (``If``/``Loop``/``Scan`` bodies), ...
        node: The node holding it, for Constant and attribute tensors.
    """

    tensor: TensorProto
    name: str
    placement: Placement
    graph: GraphProto
    depth: int
    node: NodeProto | None = None


def _subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == AttributeProto.GRAPHS:
            yield from attr.graphs


def iter_graphs(graph: GraphProto, depth: int = 0) -> Iterator[tuple[GraphProto, int]]:
    """``graph`` and every subgraph below it (``If``/``Loop``/``Scan`` bodies), depth first."""
    yield graph, depth
    for node in graph.node:
        for sub in _subgraphs(node):
            yield from iter_graphs(sub, depth + 1)


def constant_value(node: NodeProto) -> TensorProto | None:
    """The tensor of a ``Constant`` node's ``value`` attribute, or None for any other node."""
    if node.op_type != "Constant" or node.domain not in _DEFAULT_DOMAINS:
        return None
    for attr in node.attribute:
        if attr.name == "value" and attr.type == AttributeProto.TENSOR:
            value: TensorProto = attr.t
            return value
    return None


def iter_tensors(graph: GraphProto) -> Iterator[TensorRef]:
    """Every tensor of ``graph`` and its subgraphs, with its placement.

    Initializers, sparse initializers (values and indices), ``Constant`` values and every other
    TENSOR/TENSORS attribute, at any depth. Callers pick the placements they act on.
    """
    for g, depth in iter_graphs(graph):
        for tensor in g.initializer:
            yield TensorRef(tensor, tensor.name, Placement.INITIALIZER, g, depth)
        for sparse in g.sparse_initializer:
            name = sparse.values.name
            yield TensorRef(sparse.values, name, Placement.SPARSE, g, depth)
            yield TensorRef(sparse.indices, f"{name}.indices", Placement.SPARSE, g, depth)
        for node in g.node:
            constant = constant_value(node) is not None
            for attr in node.attribute:
                if attr.type == AttributeProto.TENSOR:
                    held: TensorProto = attr.t
                    if constant and attr.name == "value":
                        out = node.output[0] if node.output else held.name
                        yield TensorRef(held, out, Placement.CONSTANT, g, depth, node)
                    else:
                        name = held.name or f"{node.name or node.op_type}.{attr.name}"
                        yield TensorRef(held, name, Placement.ATTRIBUTE, g, depth, node)
                elif attr.type == AttributeProto.TENSORS:
                    for i, t in enumerate(attr.tensors):
                        name = t.name or f"{node.name or node.op_type}.{attr.name}[{i}]"
                        yield TensorRef(t, name, Placement.ATTRIBUTE, g, depth, node)


# Domains whose operators keep their parameters in list attributes (FLOATS, INTS, STRINGS):
# LinearClassifier's coefficients, TreeEnsemble's nodes and leaves, SVM's support vectors.
_PARAMETER_DOMAINS = ("ai.onnx.ml",)


def iter_attribute_weights(graph: GraphProto) -> Iterator[tuple[NodeProto, AttributeProto, int]]:
    """``(node, attribute, bytes)`` of every list attribute that holds a model's parameters.

    ``ai.onnx.ml`` operators keep their weights in FLOATS/INTS/STRINGS attributes, not in
    tensors, so :func:`iter_tensors` does not see them; ORT copies them into each session's
    kernel. Bytes are as stored (4 per float, 8 per int, a string's length). Other domains'
    list attributes (``perm``, ``axes``, ``pads``) are settings, not weights, and are skipped.
    """
    for g, _depth in iter_graphs(graph):
        for node in g.node:
            if node.domain not in _PARAMETER_DOMAINS:
                continue
            for attr in node.attribute:
                if attr.type == AttributeProto.STRINGS:
                    size = sum(len(v) for v in attr.strings)
                elif attr.type == AttributeProto.FLOATS:
                    size = 4 * len(attr.floats)
                elif attr.type == AttributeProto.INTS:
                    size = 8 * len(attr.ints)
                else:
                    continue
                if size:
                    yield node, attr, size


def _element_bits(data_type: int) -> int:
    four_bit = {TensorProto.INT4, TensorProto.UINT4, getattr(TensorProto, "FLOAT4E2M1", -1)}
    if data_type in four_bit:
        return 4
    try:
        return 8 * np_dtype(data_type).itemsize
    except Exception:
        return 0  # unknown or undefined type: its size cannot be checked


def tensor_nbytes(tensor: TensorProto) -> int | None:
    """The byte size a tensor's data must have, or None where it cannot be known (strings).

    Raises:
        InvalidModelError: a negative dimension.
    """
    if tensor.data_type == TensorProto.STRING:
        return None
    bits = _element_bits(tensor.data_type)
    if bits == 0:
        return None
    if any(d < 0 for d in tensor.dims):
        raise InvalidModelError(
            f"Tensor '{tensor.name or '<unnamed>'}' has a negative dimension {list(tensor.dims)}."
        )
    count = int(math.prod(tensor.dims))
    return (count * bits + 7) // 8


def is_external(tensor: TensorProto) -> bool:
    """Whether the tensor's data lives in an external file."""
    return tensor.data_location == TensorProto.EXTERNAL


def inline_bytes(tensor: TensorProto) -> bytes:
    """The raw little-endian bytes of an inline tensor, from ``raw_data`` or typed fields."""
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    from onnx import numpy_helper  # typed fields: rare, and only prepare reads them

    return numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data


@dataclasses.dataclass(frozen=True)
class ExternalData:
    """A tensor's ``external_data`` entries, parsed (not yet checked against any file).

    Attributes:
        location: The file, relative to the model's folder ("" when missing).
        offset: Byte offset in it, or None when the entries' offset is not an integer.
        length: Byte length, or None when absent (or not an integer: see ``malformed``).
        entries: Every entry, as ``(key, value)`` pairs in file order (``prepacked_*`` too).
        malformed: Offset or length present but not a non-negative integer.
    """

    location: str
    offset: int
    length: int | None
    entries: tuple[tuple[str, str], ...]
    malformed: bool = False

    @classmethod
    def of(cls, tensor: TensorProto) -> ExternalData | None:
        """The parsed entries of an external tensor; None for a tensor stored inline."""
        if not is_external(tensor):
            return None
        entries = tuple((e.key, e.value) for e in tensor.external_data)
        info = dict(entries)
        malformed = False
        try:
            offset = int(info.get("offset", "0"))
            length = int(info["length"]) if "length" in info else None
        except ValueError:
            offset, length, malformed = 0, None, True
        if offset < 0 or (length is not None and length < 0):
            malformed = True
        return cls(info.get("location", ""), offset, length, entries, malformed)

    def get(self, key: str) -> str | None:
        """The value of entry ``key``, or None."""
        return dict(self.entries).get(key)


@dataclasses.dataclass(frozen=True)
class ExternalSlice:
    """A tensor's bytes in a file, checked: the file is inside the model's folder and long enough.

    Attributes:
        file: The resolved file.
        offset: Where the tensor's bytes start.
        length: How many bytes it has.
        folder: The model's resolved folder, which ``file`` lies in.
        location: The location as the tensor names it.
    """

    file: Path
    offset: int
    length: int
    folder: Path
    location: str

    def open(self, tensor_name: str) -> BinaryIO:
        """Open ``file`` for reading without following a symlink below ``folder``, and check it.

        Between :func:`resolve_external`'s check and this open, a symlink may have been swapped
        into the path; the open refuses it instead of reading what the link points to (see
        :func:`sharedml._host._files.open_below`). The descriptor itself is then checked: a regular
        file that still holds the slice. Read from the returned file only.

        Raises:
            UnsafePathError: a component of the path became a symlink.
            ExternalDataError: the file vanished, is no longer a regular file, or is too short.
        """
        where = f"Tensor '{tensor_name}': external data file '{self.file}'"
        try:
            fd = _files.open_below(self.folder, self.file)
        except _files.LinkSwappedError:
            raise UnsafePathError(
                f"{where} changed into a symlink while prepare opened it (someone is swapping "
                f"files in '{self.folder}'); nothing outside the model's folder was read."
            ) from None
        except OSError as exc:
            raise ExternalDataError(f"{where} cannot be opened ({exc.strerror or exc}).") from None
        fh = os.fdopen(fd, "rb")
        try:
            self.check_open(fh, tensor_name)
        except BaseException:
            fh.close()
            raise
        return fh

    def check_open(self, fh: BinaryIO, tensor_name: str) -> None:
        """Check that the open file ``fh`` is a regular file that holds this slice.

        Raises:
            ExternalDataError: it is not a regular file, or it is shorter than the slice needs.
        """
        st = os.fstat(fh.fileno())
        where = f"Tensor '{tensor_name}': external data file '{self.file}'"
        if not stat.S_ISREG(st.st_mode):
            raise ExternalDataError(
                f"{where} is not a regular file: it is {_files.file_kind(st.st_mode)}."
            )
        if self.offset + self.length > st.st_size:
            end = self.offset + self.length
            raise ExternalDataError(
                f"{where} has {st.st_size} bytes, but bytes {self.offset}..{end} are needed: it "
                "was truncated while prepare read it."
            )


ResolvedFiles = dict[tuple[Path, str], tuple[Path, Path, os.stat_result]]
"""Locations already resolved in one pass over a model: (folder, location) -> (the folder
resolved, the file resolved, its stat). A model of 100,000 tensors in one file resolves it once."""


def resolve_external(
    tensor: TensorProto, model_path: Path, *, resolved_files: ResolvedFiles | None = None
) -> ExternalSlice:
    """Check an external tensor's location, offset and length against the file system.

    ``resolved_files`` spares resolving a location again that an earlier tensor of the same
    pass used; the open that reads it checks the path again (:meth:`ExternalSlice.open`).

    Raises:
        UnsafePathError: the location is absolute, holds a NUL byte, or resolves outside the
            model's folder (``..``, a symlink that escapes).
        ExternalDataError: no location, a missing file or one that is not a regular file (a
            FIFO, a device, a folder), malformed or out-of-range offsets, or a length that does
            not match the tensor's shape.
    """
    info = ExternalData.of(tensor)
    assert info is not None, "resolve_external takes external tensors only"
    name = tensor.name or "<unnamed>"
    location = info.location
    where = f"Tensor '{name}' in '{model_path}'"
    if not location:
        raise ExternalDataError(f"{where} uses external data but names no location.")
    if "\0" in location:
        raise UnsafePathError(
            f"{where}: external data location {location!r} contains a NUL byte, which would "
            "make ONNX Runtime and sharedml read different files."
        )
    if os.path.isabs(location) or Path(location).drive or location.startswith(("/", "\\")):
        raise UnsafePathError(
            f"{where}: external data location '{location}' is an absolute path; locations must "
            "be relative to the model's folder."
        )
    base = model_path.parent
    known = resolved_files.get((base, location)) if resolved_files is not None else None
    if known is None:
        known = _resolve_file(base, location, where)
        if resolved_files is not None:
            resolved_files[(base, location)] = known
    real_base, resolved, st = known
    if info.malformed:
        raise ExternalDataError(
            f"{where}: external data offset/length are not non-negative integers."
        )
    expected = tensor_nbytes(tensor)
    length = info.length
    if length is None:
        if expected is None:
            raise ExternalDataError(
                f"{where}: external data has no length and its size cannot be derived from its "
                "type."
            )
        length = expected
    file_size = st.st_size
    if info.offset + length > file_size:
        raise ExternalDataError(
            f"{where}: bytes {info.offset}..{info.offset + length} lie outside external data "
            f"file '{resolved}' ({file_size} bytes). The file is truncated or the model is "
            "corrupt."
        )
    if expected is not None and length != expected:
        raise ExternalDataError(
            f"{where}: external data length {length} does not match its shape "
            f"{list(tensor.dims)} ({expected} bytes)."
        )
    return ExternalSlice(resolved, info.offset, length, real_base, location)


def _resolve_file(base: Path, location: str, where: str) -> tuple[Path, Path, os.stat_result]:
    """The resolved folder, the resolved file and its stat, for a location checked to be safe."""
    try:
        real_base = Path(os.path.realpath(base))
        resolved = Path(os.path.realpath(base / location))
    except OSError as exc:  # a link that changed while it was being resolved
        raise ExternalDataError(
            f"{where}: external data location '{location}' changed while it was resolved "
            f"({exc.strerror or exc}); is something swapping files in '{base}'?"
        ) from None
    if os.path.commonpath([real_base, resolved]) != str(real_base):
        raise UnsafePathError(
            f"{where}: external data location '{location}' resolves to '{resolved}', which is "
            f"outside the model's folder '{real_base}'."
        )
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        raise ExternalDataError(
            f"{where}: external data file '{resolved}' does not exist."
        ) from None
    except OSError as exc:
        raise ExternalDataError(
            f"{where}: external data file '{resolved}' cannot be read ({exc.strerror or exc})."
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ExternalDataError(
            f"{where}: external data file '{resolved}' is not a regular file: it is "
            f"{_files.file_kind(st.st_mode)}. External data must be a regular file."
        )
    return real_base, resolved, st


_DATA_FIELDS = (
    "raw_data",
    "float_data",
    "int32_data",
    "int64_data",
    "double_data",
    "uint64_data",
    "string_data",
)


def set_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    """Point ``tensor`` at ``length`` bytes of ``location`` from ``offset``; drop inline data."""
    for field in _DATA_FIELDS:
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def external_locations(graph: GraphProto) -> set[str]:
    """Every external data location the tensors of ``graph`` (and its subgraphs) name."""
    return {
        info.location
        for ref in iter_tensors(graph)
        if (info := ExternalData.of(ref.tensor)) is not None
    }
