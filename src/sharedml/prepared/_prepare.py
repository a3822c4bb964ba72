"""Rewrite a model so that every weight lives in one aligned, memory-mappable file.

``prepare(src, dst)`` writes ``dst`` (the graph: small) and ``<dst stem>.weights`` beside it.
Every tensor of at least ``size_threshold_bytes`` moves into the weights file, wherever it was
in the source: an initializer stored inline or in external data files, a ``Constant`` node
(turned into an initializer of the same graph, as ORT itself does at load), or either of those
inside ``If``/``Loop``/``Scan`` bodies at any depth.

Layout (:meth:`WeightsManifest.alignment_for`): a tensor of at least ``alignment_bytes`` (a
page by default) starts at a multiple of it, so that a mapping hands ORT page-aligned buffers;
a smaller one starts at a multiple of 64 bytes, or of the largest power of two not above its
size when it is smaller still, which is still a multiple of its element size. Every tensor's
padding is thus smaller than the tensor, so the weights file stays under twice the tensor data
plus one page, whatever the model (100,000 one-byte tensors no longer cost a page each).

The data is streamed: external tensors are copied in chunks, so peak memory is about one chunk
plus the graph, not the model's size. Models over 2 GB arrive with external data and prepare
the same way. Every byte is read once, from a file opened without following symlinks below the
model's folder, and hashed as it is copied (``PrepareResult.source_sha256``), so the cache keys
an entry by exactly what it holds. The outputs appear atomically (temporary files, then
``os.replace``), read-only, and never over the source model or its data files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import operator
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, overload

from sharedml import _host
from sharedml._errors import (
    CacheError,
    ExternalDataError,
    InvalidModelError,
    OutputError,
    PrepareError,
    SharedMLError,
    UnsafePathError,
)
from sharedml._host import fsync_dir
from sharedml.cache._entries import Built, ensure_entry
from sharedml.cache._files import temp_is_stale, temp_owner
from sharedml.cache._locks import lend_hold
from sharedml.cache._root import Cache, CacheDir
from sharedml.cache._stamps import Snapshot, recall_stamp, record_stamp, snapshot
from sharedml.model._graph import (
    ExternalSlice,
    Placement,
    ResolvedFiles,
    external_locations,
    inline_bytes,
    is_external,
    iter_tensors,
    load_graph,
    read_model,
    resolve_external,
    set_external,
    tensor_nbytes,
)
from sharedml.model._proto import ModelProto, TensorProto, parse_model

if TYPE_CHECKING:
    from sharedml.prepared._family import FamilyResult

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "DEFAULT_SIZE_THRESHOLD_BYTES",
    "MAX_ALIGNMENT_BYTES",
    "SMALL_ALIGNMENT_BYTES",
    "MANIFEST_KEY",
    "PrepareResult",
    "WeightsManifest",
    "WeightsPlan",
    "check_settings",
    "check_threshold",
    "content_key",
    "load_graph",
    "plan_weights",
    "prepare",
    "prepared_model_for",
    "prepared_model_from_bytes",
    "read_manifest",
    "weights_path_for",
    "SharedWeights",
]

DEFAULT_ALIGNMENT_BYTES = 4096  # bytes: one page, so every large tensor is mapped page-aligned
# bytes: the largest alignment prepare accepts. 1 GiB is the largest huge page (x86-64); beyond
# it no mapping gains anything, and a typo (a TiB) must be a clear error, not a huge file.
MAX_ALIGNMENT_BYTES = 1 << 30
# bytes: where tensors smaller than the alignment start. A cache line, and a multiple of every
# element size (complex128 is 16 bytes), which is what ORT's kernels and DLPack views need.
SMALL_ALIGNMENT_BYTES = 64
DEFAULT_SIZE_THRESHOLD_BYTES = 1024  # bytes: what onnx's own external-data helpers use
MANIFEST_KEY = "sharedml.weights"  # metadata_props key of the prepared model
# 2: tensors smaller than alignment_bytes start at SMALL_ALIGNMENT_BYTES (1: every tensor at
# alignment_bytes). Format 1 files still load: their offsets satisfy the format 2 rule.
# 3: tensors may also sit in other weights files of the folder (``shared``: hard links to the
# files of other cache entries holding the same tensors). Written only where ``shared`` is used.
_FORMAT_VERSION = 2
_SHARED_FORMAT_VERSION = 3
_READABLE_FORMATS = (1, 2, 3)
_END_ALIGNMENT_BYTES = 4096  # bytes: the file ends on a page, as a mapping does
_CHUNK_BYTES = 16 * 1024 * 1024  # bytes copied at a time: bounds prepare's peak memory
_ZEROS = bytes(64 * 1024)  # padding is written from this, so no padding is ever allocated
_NAME_MAX_BYTES = 255  # bytes in one file name (NAME_MAX on Linux, macOS and NTFS)
# Tensors under this many bytes always stay inline, whatever the threshold: shape inference at
# load must read small constant inputs (Reshape's shape, Slice's starts) from the graph, and ORT
# copies external tensors this small into the graph at load anyway.
_ALWAYS_INLINE_BYTES = 128

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` while the weights file is written."""


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _is_power_of_two(n: object) -> bool:
    return isinstance(n, int) and n > 0 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class SharedWeights:
    """Another weights file of the folder that some of a prepared model's tensors sit in.

    Attributes:
        file: Its name, relative to the model's folder.
        size_bytes: Its exact size.
        sha256: Hex SHA-256 of its whole content.
    """

    file: str
    size_bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class WeightsManifest:
    """What a prepared model records about its weights file, to verify it at load.

    Attributes:
        file: The weights file's name, relative to the model's folder.
        size_bytes: Its exact size.
        sha256: Hex SHA-256 of its whole content.
        alignment_bytes: Where tensors of at least this size start: at multiples of it.
        tensors: How many tensors the file holds.
        small_alignment_bytes: Where smaller tensors start (see :meth:`alignment_for`).
            Files of format 1, which aligned every tensor to ``alignment_bytes``, read as
            ``alignment_bytes`` here.
        shared: Other weights files of the folder, laid out by the same rule, that tensors of
            the graph sit in (format 3): a cache entry's hard links to the files of entries
            holding the same tensors (:mod:`sharedml.prepared._dedupe`). Empty for everything
            :func:`sharedml.prepare` writes.
    """

    file: str
    size_bytes: int
    sha256: str
    alignment_bytes: int
    tensors: int
    small_alignment_bytes: int = SMALL_ALIGNMENT_BYTES
    shared: tuple[SharedWeights, ...] = ()

    @property
    def files(self) -> tuple[SharedWeights, ...]:
        """Every weights file the graph refers to: ``file`` first, then ``shared``."""
        return (SharedWeights(self.file, self.size_bytes, self.sha256), *self.shared)

    def alignment_for(self, nbytes: int) -> int:
        """The alignment of a tensor of ``nbytes`` in this file: prepare's layout rule.

        ``alignment_bytes`` for a tensor at least that large (mapped page-aligned); else
        ``small_alignment_bytes``, or the largest power of two not above ``nbytes`` where that
        is smaller. The last keeps every padding below its tensor's size (the file stays under
        twice its data) and is still a multiple of the element size, which divides ``nbytes``.
        The weight store refuses an offset that breaks this rule (a graph changed after
        prepare).
        """
        if nbytes >= self.alignment_bytes:
            return self.alignment_bytes
        return min(self.small_alignment_bytes, _floor_power_of_two(nbytes))

    def to_json(self) -> str:
        """Serialize as stored in the model's ``metadata_props``."""
        fields = dataclasses.asdict(self)
        if not self.shared:  # readable by every sharedml that reads format 2
            del fields["shared"]
        version = _SHARED_FORMAT_VERSION if self.shared else _FORMAT_VERSION
        return json.dumps({"format": version, **fields}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WeightsManifest:
        """Parse the stored form; raises ``InvalidModelError`` when malformed."""
        try:
            raw = json.loads(text)
            version = raw.pop("format")
            if version not in _READABLE_FORMATS:
                raise InvalidModelError(
                    f"The {MANIFEST_KEY} metadata has format {version!r}, which this sharedml "
                    f"does not read (it reads {', '.join(map(str, _READABLE_FORMATS))}): prepare "
                    "the model again with this version of sharedml."
                )
            if version == 1:  # every tensor at alignment_bytes
                raw.setdefault("small_alignment_bytes", raw.get("alignment_bytes"))
            raw["shared"] = tuple(SharedWeights(**item) for item in raw.get("shared", ()))
            manifest = cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            if isinstance(exc, InvalidModelError):
                raise
            raise InvalidModelError(f"Malformed {MANIFEST_KEY} metadata: {exc}") from None
        if not (
            _is_power_of_two(manifest.alignment_bytes)
            and _is_power_of_two(manifest.small_alignment_bytes)
        ):
            raise InvalidModelError(
                f"Malformed {MANIFEST_KEY} metadata: alignments {manifest.alignment_bytes} and "
                f"{manifest.small_alignment_bytes} are not powers of two. Prepare the model again."
            )
        names = [f.file for f in manifest.files]
        for name in names:
            if Path(name).name != name or name in ("", ".", ".."):
                raise UnsafePathError(
                    f"The prepared model names weights file {name!r}, which is not a plain "
                    "file name in the model's folder."
                )
        if len(set(names)) != len(names):
            raise InvalidModelError(
                f"Malformed {MANIFEST_KEY} metadata: a weights file is named twice ({names})."
            )
        return manifest


@dataclasses.dataclass(frozen=True)
class PrepareResult:
    """What ``prepare`` wrote.

    Attributes:
        model_path: The prepared graph file.
        weights_path: The weights file beside it.
        tensors_moved: Tensors now in the weights file.
        bytes_moved: Their data size (without alignment padding).
        tensors_inline: Tensors left in the graph (initializers and ``Constant`` nodes below the
            threshold, strings).
        bytes_inline: Their data size.
        constants_converted: ``Constant`` nodes turned into initializers.
        manifest: The record stored in the model to verify the weights file.
        source_sha256: Hex SHA-256 of exactly the source bytes prepare read to write these
            files, in the one read that copied them: the model file, then each external slice
            it copied (with its location, offset and length). Equal digests (with equal
            settings) mean equal outputs; the cache keys its entries by it.
    """

    model_path: Path
    weights_path: Path
    tensors_moved: int
    bytes_moved: int
    tensors_inline: int
    bytes_inline: int
    constants_converted: int
    manifest: WeightsManifest
    source_sha256: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``sharedml prepare --json`` prints)."""
        return {
            "model_path": str(self.model_path),
            "weights_path": str(self.weights_path),
            "tensors_moved": self.tensors_moved,
            "bytes_moved": self.bytes_moved,
            "tensors_inline": self.tensors_inline,
            "bytes_inline": self.bytes_inline,
            "constants_converted": self.constants_converted,
            "weights_file_bytes": self.manifest.size_bytes,
            "weights_sha256": self.manifest.sha256,
            "source_sha256": self.source_sha256,
        }


def weights_path_for(model_path: str | os.PathLike[str]) -> Path:
    """The weights file that ``prepare`` writes beside ``model_path``."""
    path = Path(model_path)
    return path.with_name(path.stem + ".weights")


def read_manifest(model: ModelProto) -> WeightsManifest | None:
    """The weights record of a prepared model, or ``None`` for a model prepare did not write."""
    for prop in model.metadata_props:
        if prop.key == MANIFEST_KEY:
            return WeightsManifest.from_json(prop.value)
    return None


# --------------------------------------------------------------------------------------------
# The plan: which tensors move, computed before any byte is written


@dataclasses.dataclass
class _Source:
    """Where a tensor's bytes come from: a checked slice of a file, or bytes in the graph."""

    tensor: TensorProto
    nbytes: int
    piece: ExternalSlice | None = None

    @property
    def file(self) -> Path | None:
        return self.piece.file if self.piece is not None else None

    @property
    def offset(self) -> int:
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

    moving: list[_Source]
    inline_tensors: int
    inline_bytes: int
    constants_converted: int

    @property
    def moving_bytes(self) -> int:
        """Data bytes of the tensors that move (without alignment padding)."""
        return sum(s.nbytes for s in self.moving)


def _source_of(tensor: TensorProto, model_path: Path, files: ResolvedFiles) -> _Source | None:
    if is_external(tensor):
        piece = resolve_external(tensor, model_path, resolved_files=files)
        return _Source(tensor=tensor, nbytes=piece.length, piece=piece)
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
    return _Source(tensor=tensor, nbytes=expected)


def _check_overlaps(sources: list[_Source], model_path: Path) -> None:
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
    moving: list[_Source] = []
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


# --------------------------------------------------------------------------------------------
# Reading: every source byte once, hashed as it is handed out


class _SourceReader:
    """Hands out the source bytes prepare copies, each read once, and hashes exactly those.

    The digest covers the model file's bytes, then, in plan order, each external slice read
    (framed by its index in the plan, its location, offset and length) and each tied tensor's
    reuse of an earlier slice. prepare's output is a function of exactly this sequence, so an
    entry keyed by the digest holds what its key says even when a source file changes between
    a key lookup and the copy, or during the copy: the changed bytes get their own key.

    One external file is open at a time: models with a file per tensor have thousands.
    """

    def __init__(self, model_bytes: bytes) -> None:
        self._sha = hashlib.sha256(f"sharedml-source:1:{len(model_bytes)}\n".encode())
        self._sha.update(model_bytes)
        self._open: tuple[Path, BinaryIO] | None = None

    def hexdigest(self) -> str:
        """The digest of everything handed out so far."""
        return self._sha.hexdigest()

    def tied(self, index: int, earlier: int) -> None:
        """Record that tensor ``index`` of the plan reuses the bytes of tensor ``earlier``."""
        self._sha.update(f"\n{index} = {earlier}\n".encode())

    def read(self, index: int, piece: ExternalSlice, name: str) -> Iterator[bytes]:
        """The bytes of tensor ``index`` (``name``), in chunks, from a checked open file."""
        fh = self._file(piece, name)
        self._sha.update(f"\n{index} {piece.location!r} {piece.offset} {piece.length}\n".encode())
        fh.seek(piece.offset)
        remaining = piece.length
        while remaining:
            try:
                chunk = fh.read(min(_CHUNK_BYTES, remaining))
            except OSError as exc:
                raise ExternalDataError(
                    f"Reading tensor '{name}' from external data file '{piece.file}' failed "
                    f"({exc.strerror or exc})."
                ) from None
            if not chunk:
                raise ExternalDataError(
                    f"External data file '{piece.file}' ended early while reading tensor '{name}'."
                )
            self._sha.update(chunk)
            remaining -= len(chunk)
            yield chunk

    def _file(self, piece: ExternalSlice, name: str) -> BinaryIO:
        if self._open is not None:
            if self._open[0] == piece.file:
                piece.check_open(self._open[1], name)
                return self._open[1]
            self.close()
        fh = piece.open(name)
        self._open = (piece.file, fh)
        return fh

    def close(self) -> None:
        """Close the open external file, if any."""
        if self._open is not None:
            self._open[1].close()
            self._open = None


def _reads(moving: list[_Source]) -> Iterator[tuple[int, _Source, int | None]]:
    """Each tensor that moves, with the index of an earlier one whose bytes it shares (tied)."""
    first: dict[tuple[Path, int, int], int] = {}
    for index, src in enumerate(moving):
        if src.piece is None:
            yield index, src, None
            continue
        earlier = first.setdefault((src.piece.file, src.piece.offset, src.nbytes), index)
        yield index, src, earlier if earlier != index else None


def _hash_sources(moving: list[_Source], reader: _SourceReader) -> None:
    """Feed ``reader`` what :func:`_write_weights` would read, without writing anything."""
    for index, src, earlier in _reads(moving):
        if earlier is not None:
            reader.tied(index, earlier)
        elif src.piece is not None:
            for _chunk in reader.read(index, src.piece, src.tensor.name):
                pass


# --------------------------------------------------------------------------------------------
# Writing


class _HashingWriter:
    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self.position = 0
        self.sha = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> None:
        self._fh.write(data)
        self.sha.update(data)
        self.position += len(data)

    def pad_to(self, alignment: int) -> None:
        pad = -self.position % alignment
        while pad:  # from a small buffer of zeros: padding costs no memory, whatever its size
            step = min(pad, len(_ZEROS))
            self.write(memoryview(_ZEROS)[:step])
            pad -= step


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _write_weights(
    moving: list[_Source],
    writer: _HashingWriter,
    reader: _SourceReader,
    layout: WeightsManifest,
    progress: ProgressCallback | None,
) -> None:
    total = sum(src.nbytes for src in moving)
    done = 0
    placed: dict[int, int] = {}  # plan index -> offset; tied weights are written once
    for index, src, earlier in _reads(moving):
        if earlier is not None:
            reader.tied(index, earlier)
            start = placed[earlier]
        else:
            writer.pad_to(layout.alignment_for(src.nbytes))
            start = writer.position
            if src.piece is None:
                data = inline_bytes(src.tensor)
                writer.write(data)
                del data
            else:
                for chunk in reader.read(index, src.piece, src.tensor.name):
                    writer.write(chunk)
                    if progress is not None:
                        progress(done + writer.position - start, total)
        placed[index] = start
        set_external(src.tensor, layout.file, start, src.nbytes)
        done += src.nbytes
        if progress is not None:
            progress(done, total)
    writer.pad_to(_END_ALIGNMENT_BYTES)


def _replace_metadata(model: ModelProto, manifest: WeightsManifest) -> None:
    keep = [p for p in model.metadata_props if p.key != MANIFEST_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    entry = model.metadata_props.add()
    entry.key, entry.value = MANIFEST_KEY, manifest.to_json()


# Temporary outputs: ``.<output name>.<owner>-<12 hex>.tmp`` beside the output (the owner, see
# sharedml.cache._files.temp_owner, since this version; older ones have none).
_TEMP_NAME = re.compile(
    r"\.(?P<name>.+)\.(?:(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)-)?[0-9a-f]{12}\.tmp"
)


def _create_temp(final: Path) -> tuple[int, Path]:
    """A new temporary file beside ``final``: read-only for everyone the umask lets read it.

    The mode is 0444 less the umask (``tempfile.mkstemp`` would make it 0600, so a prepared
    model would be unreadable by the other users a deployment often runs its workers as).
    Read-only because the weights file is mapped by running pools: a ``cp`` over it (an
    in-place rewrite) would crash them with SIGBUS, and read-only makes ``cp`` fail for
    everyone but root, while the renames that prepare itself replaces files with still work.
    Windows: 0666, since there a read-only file cannot be replaced by a rename.

    The name records this process (:func:`sharedml.cache._files.temp_owner`), so that the next
    prepare into the folder removes what a killed one left (:func:`_remove_dead_temps`), and
    keeps at most what fits NAME_MAX with its owner and random part, so that an output name of
    up to 255 bytes works.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    mode = 0o444 if os.name == "posix" else 0o666
    for _ in range(100):
        suffix = f".{temp_owner()}-{secrets.token_hex(6)}.tmp"
        keep = final.name
        while len(os.fsencode(f".{keep}{suffix}")) > _NAME_MAX_BYTES:
            keep = keep[:-1]
        path = final.with_name(f".{keep}{suffix}")
        try:
            return os.open(path, flags, mode), path
        except FileExistsError:
            continue
    raise PrepareError(f"Could not create a temporary file beside '{final}'.")  # pragma: no cover


def _remove_dead_temps(folder: Path) -> tuple[Path, ...]:
    """Remove the temporary outputs that killed prepares left in ``folder``.

    A ``kill -9`` while prepare writes leaves its hidden temporary files (a weights file's
    worth each), which nothing else ever removes. Only files named as :func:`_create_temp`
    names them, owned by this user, and stale (their process is gone from this host, or they
    are a day old: see :func:`sharedml.cache._files.temp_is_stale`) are removed: never a live
    prepare's, in this process or another.
    """
    removed = []
    try:
        children = list(os.scandir(folder))
    except OSError:
        return ()
    for child in children:
        match = _TEMP_NAME.fullmatch(child.name)
        if match is None:
            continue
        try:
            st = child.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (os.name == "posix" and st.st_uid != os.geteuid()):
            continue
        owner = (match["host"], int(match["pid"])) if match["host"] else None
        if temp_is_stale(Path(child.path), owner):
            with contextlib.suppress(OSError):
                os.unlink(child.path)
                removed.append(Path(child.path))
    return tuple(removed)


def _check_outputs(src_path: Path, model: ModelProto, dst_path: Path, weights_path: Path) -> None:
    """Refuse outputs that are not regular files, or that are any of prepare's inputs.

    Inputs are the source model and every external data file it names (moved or not): writing
    over one destroys the source (``prepare("model.onnx", "model.onnx.data")``). An existing
    output must be a regular file: ``os.replace`` would replace a symlink itself, and, as root,
    a device (``-o /dev/null``) or a FIFO.

    Raises:
        PrepareError: naming the output, what it is, and the fix.
    """
    if weights_path == dst_path:
        raise PrepareError(
            f"'{dst_path}' is also the name prepare gives the weights file (the graph file's stem "
            "+ '.weights'); name the graph file differently, e.g. "
            f"'{dst_path.with_suffix('.onnx')}'. Nothing was written."
        )
    inputs = [(src_path, "the source model")]
    inputs += [
        (src_path.parent / location, f"external data of the source model '{src_path}'")
        for location in sorted(external_locations(model.graph))
        if location and "\0" not in location
    ]
    for out in (dst_path, weights_path):
        try:
            st = os.lstat(out)
        except OSError:  # absent (or its folder is): nothing to protect, and a clear error later
            continue
        if not stat.S_ISREG(st.st_mode):
            raise PrepareError(
                f"prepare would replace '{out}', which is {_host.file_kind(st.st_mode)}; it "
                "replaces only regular files. Remove it or choose another output path. Nothing "
                "was written."
            )
        for path, what in inputs:
            if _same_file(out, path):
                raise PrepareError(
                    f"prepare would overwrite its source: '{out}' is {what}. Nothing was "
                    "written; write the prepared model to another path (e.g. -o "
                    "model.prepared.onnx)."
                )


_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)


_WINDOWS_IN_USE = (5, 32)  # ERROR_ACCESS_DENIED, ERROR_SHARING_VIOLATION


def _in_use_on_windows(path: Path, exc: OSError) -> bool:
    """Whether Windows refused to replace ``path`` because a process has it open or mapped.

    There the old file cannot be replaced while it is mapped; on POSIX the rename lands and
    processes keep the old inode.
    """
    return (
        os.name == "nt"
        and getattr(exc, "winerror", None) in _WINDOWS_IN_USE
        and os.path.lexists(path)
    )


def _output_error(path: Path, exc: OSError) -> OutputError:
    """An :class:`OutputError` that names ``path``, the OS's reason and the fix."""
    code = exc.errno
    folder = path.parent
    if code in (errno.ENOSPC, _EDQUOT):
        fix = f"free space on the filesystem of '{folder}', or write the prepared model elsewhere"
    elif code == errno.EFBIG:
        fix = (
            "the file outgrew the filesystem's or this process's file size limit ('ulimit -f'); "
            "raise the limit or write the prepared model elsewhere"
        )
    elif _in_use_on_windows(path, exc):
        fix = (
            "it is in use: Windows refuses to replace a file that a process has open or mapped "
            "(a SessionPool over this prepared model); close those pools first, or prepare to a "
            "new path and point new pools at it"
        )
    elif code in (errno.EACCES, errno.EPERM):
        fix = f"this user may not write in '{folder}'; fix its permissions or write elsewhere"
    elif code == errno.EROFS:
        fix = f"'{folder}' is on a read-only filesystem; write the prepared model elsewhere"
    elif code == errno.ENAMETOOLONG:
        fix = "the name is longer than the filesystem allows; choose a shorter output name"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        fix = f"a part of '{folder}' is a file, not a folder; choose another output path"
    else:
        fix = f"check '{folder}', or write the prepared model elsewhere"
    error = OutputError(
        f"prepare could not write '{path}' ({exc.strerror or exc}): {fix}. The source is "
        "unchanged and no temporary file was left."
    )
    error.errno = code
    return error


def _keep_a_link(path: Path) -> Path | None:
    """A hard link to an existing ``path`` under a temporary name, to restore it from; else None.

    None too where the filesystem has no hard links: a failure then loses the old weights file
    (the old graph, still in place, refuses the new one by its recorded hash).
    """
    if not path.is_file() or path.is_symlink():
        return None
    for _ in range(100):
        link = path.with_name(f".{path.name[:200]}.{secrets.token_hex(6)}.old")
        try:
            os.link(path, link)
            return link
        except FileExistsError:
            continue
        except OSError:
            return None
    return None  # pragma: no cover


def check_settings(size_threshold_bytes: int, alignment_bytes: int) -> None:
    """Refuse prepare settings out of range (``ValueError``)."""
    if not _is_power_of_two(alignment_bytes) or not (
        DEFAULT_ALIGNMENT_BYTES <= alignment_bytes <= MAX_ALIGNMENT_BYTES
    ):
        raise ValueError(
            f"alignment_bytes must be a power of two from {DEFAULT_ALIGNMENT_BYTES} to "
            f"{MAX_ALIGNMENT_BYTES} (1 GiB), not {alignment_bytes}."
        )
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


@overload
def prepare(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    size_threshold_bytes: int = ...,
    alignment_bytes: int = ...,
    progress: ProgressCallback | None = ...,
) -> PrepareResult: ...


@overload
def prepare(
    src: list[str | os.PathLike[str]] | list[str] | list[Path] | tuple[str | os.PathLike[str], ...],
    dst: str | os.PathLike[str],
    *,
    size_threshold_bytes: int = ...,
    alignment_bytes: int = ...,
    progress: ProgressCallback | None = ...,
) -> FamilyResult: ...


def prepare(
    src: Any,
    dst: str | os.PathLike[str],
    *,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    progress: ProgressCallback | None = None,
) -> PrepareResult | FamilyResult:
    """Rewrite ``src`` into ``dst`` plus one aligned weights file beside it.

    Given a list of models (a *family*: graphs that hold the same tensors under any names),
    ``dst`` is a folder: each model is written to ``dst/<its file name>``, all of them over
    ONE weights file, ``dst/family-<sha16>.weights``, that holds each distinct tensor (same
    dtype, shape and SHA-256 of its bytes) once; see :mod:`sharedml.prepared._family`. Two members
    with
    one file name, or a member inside ``dst``, is a :class:`FamilyError`, raised before
    anything is written. Returns a :class:`~sharedml.prepared._family.FamilyResult` then.

    Args:
        src: Any ONNX model: weights inline, in external data files, in ``Constant`` nodes or
            in subgraphs. A model prepared before prepares again into an equivalent one.
        dst: The graph file to write, or an existing folder to write ``<src stem>.onnx`` into
            (as ``cp`` does). The weights go to ``<dst stem>.weights`` beside it; a missing
            folder is created. Existing regular files at both paths are replaced atomically,
            and a failure leaves both as they were (no new file, no temporary file); neither
            may be the source model or one of its data files, a symlink, a device or a FIFO.
            Both are written read-only (0444 less the umask): running pools map the weights,
            and copying a file over them would crash those pools, so replace them only by
            renames (prepare again, or ``mv``).
        size_threshold_bytes: Tensors at least this large move to the weights file; smaller
            ones stay in the graph (and those under 128 bytes always do: shape inference must
            read them). Tensors that were in external files always move.
        alignment_bytes: Tensors at least this large start at a multiple of it (a power of two
            from 4096, one page, to :data:`MAX_ALIGNMENT_BYTES`); smaller ones at a multiple of
            64 bytes or of their size's largest power of two (:meth:`WeightsManifest.
            alignment_for`), so that no padding is larger than its tensor.
        progress: Called as ``progress(bytes_done, bytes_total)`` while weights are copied.

    Returns:
        A :class:`PrepareResult` describing what was written.

    Raises:
        ValueError: ``alignment_bytes`` or ``size_threshold_bytes`` is out of range.
        ModelNotFoundError: ``src`` does not exist.
        InvalidModelError: ``src`` is not a valid ONNX model.
        ExternalDataError: external data is missing, truncated, overlapping, malformed, or not
            a regular file.
        UnsafePathError: an external data location points outside ``src``'s folder, or a
            symlink was swapped in below it while prepare opened the file.
        PrepareError: ``dst`` or its weights file would overwrite the source or its data, or
            is not a regular file.
        OutputError: the outputs could not be written (a full disk, a folder this user may
            not write, a name too long); it is also an ``OSError`` with the ``errno``.

    Thread safety: safe to call concurrently, also on the same ``dst`` (the last one wins,
    each result complete).
    """
    if isinstance(src, (list, tuple)):
        from sharedml.prepared._family import prepare_family

        return prepare_family(
            src,
            dst,
            size_threshold_bytes=size_threshold_bytes,
            alignment_bytes=alignment_bytes,
            progress=progress,
        )
    check_settings(size_threshold_bytes, alignment_bytes)
    src_path = Path(src)
    dst_path = Path(dst)
    if dst_path.is_dir() and not dst_path.is_symlink():
        dst_path = dst_path / f"{src_path.stem}.onnx"
    weights_path = weights_path_for(dst_path)
    model, model_bytes = read_model(src_path)
    reader = _SourceReader(model_bytes)
    del model_bytes
    _check_outputs(src_path, model, dst_path, weights_path)
    plan = plan_weights(model, src_path, size_threshold_bytes)
    layout = WeightsManifest(weights_path.name, 0, "", alignment_bytes, len(plan.moving))

    writing = dst_path.parent  # what an OSError below failed to write, for its message
    tmp_weights = tmp_model = None
    try:
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_temps(dst_path.parent)
        writing = weights_path
        fd, tmp_weights = _create_temp(weights_path)
        with os.fdopen(fd, "wb") as fh:
            writer = _HashingWriter(fh)
            _write_weights(plan.moving, writer, reader, layout, progress)
            fh.flush()
            os.fsync(fh.fileno())
        manifest = dataclasses.replace(
            layout, size_bytes=writer.position, sha256=writer.sha.hexdigest()
        )
        _replace_metadata(model, manifest)
        writing = dst_path
        fd, tmp_model = _create_temp(dst_path)
        with os.fdopen(fd, "wb") as fh:
            fh.write(model.SerializeToString())
            fh.flush()
            os.fsync(fh.fileno())
        # Weights first: until the graph lands, no prepared model refers to the new weights; an
        # older graph left at dst by a crash in between is caught by its recorded hash. If the
        # graph cannot land, the weights file that was there is put back (a hard link kept it).
        backup = _keep_a_link(weights_path)
        try:
            writing = weights_path
            os.replace(tmp_weights, weights_path)
            tmp_weights = None
            try:
                writing = dst_path
                os.replace(tmp_model, dst_path)
            except BaseException:
                if backup is not None:
                    os.replace(backup, weights_path)
                    backup = None
                else:
                    weights_path.unlink()
                raise
            tmp_model = None
        finally:
            if backup is not None:
                with contextlib.suppress(OSError):
                    backup.unlink()
        fsync_dir(dst_path.parent)
    except OSError as exc:
        if isinstance(exc, SharedMLError):  # UnsafePathError is a PermissionError too
            raise
        raise _output_error(writing, exc) from exc
    finally:
        reader.close()
        for leftover in (tmp_weights, tmp_model):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    leftover.unlink()

    return PrepareResult(
        model_path=dst_path,
        weights_path=weights_path,
        tensors_moved=len(plan.moving),
        bytes_moved=plan.moving_bytes,
        tensors_inline=plan.inline_tensors,
        bytes_inline=plan.inline_bytes,
        constants_converted=plan.constants_converted,
        manifest=manifest,
        source_sha256=reader.hexdigest(),
    )


# --------------------------------------------------------------------------------------------
# Prepared once per content: the cache's ``models`` entries

_BYTES_SOURCE = "<model bytes>"  # what an entry made from bytes records as its source
_KEY_VERSION = "3"  # bump when prepare's output format, or what the key covers, changes
_PREPARED_NAME = "model.onnx"


def _key_of(source_sha256: str, size_threshold_bytes: int) -> str:
    """The ``models`` entry key of a source whose bytes hash to ``source_sha256``."""
    text = f"sharedml-cache:{_KEY_VERSION}:{size_threshold_bytes}:{source_sha256}"
    return hashlib.sha256(text.encode()).hexdigest()


def _source_key(
    path: Path, model: ModelProto, model_bytes: bytes, before: Snapshot, size_threshold_bytes: int
) -> tuple[str, Snapshot]:
    """The entry key of a source, from the reads prepare would make, and what they covered.

    ``model`` and ``model_bytes`` are one read of ``path``, made after ``before`` was taken.
    The external data files are snapshotted before their bytes are read, so that a stamp of
    the result vouches only for files that did not change while they were hashed.

    Returns:
        The key (:func:`_key_of` of the same digest prepare computes while copying) and the
        snapshot of the model and of every external data file it names, as named (a symlink
        retargeted later resolves elsewhere, and the stamp no longer matches).
    """
    reader = _SourceReader(model_bytes)
    plan = plan_weights(model, path, size_threshold_bytes)
    named = [
        path.parent / location
        for location in sorted(external_locations(model.graph))
        if "\0" not in location
    ]
    before = before.extended(named)
    try:
        _hash_sources(plan.moving, reader)
    finally:
        reader.close()
    return _key_of(reader.hexdigest(), size_threshold_bytes), before


def content_key(model_path: str | os.PathLike[str], *, size_threshold_bytes: int) -> str:
    """The cache key of a source model: a SHA-256 over what prepare would read, and settings.

    What prepare would read is the model file and the slice of every external data file that
    its tensors use, exactly as :attr:`PrepareResult.source_sha256` hashes them.
    """
    path = Path(model_path)
    before = snapshot(path)
    model, model_bytes = read_model(path)
    return _source_key(path, model, model_bytes, before, size_threshold_bytes)[0]


def prepared_model_for(
    model_path: str | os.PathLike[str],
    *,
    cache_dir: CacheDir = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    verify: bool = True,
    copy_prepared: bool = False,
) -> Path:
    """A prepared model equivalent to ``model_path``: itself if prepared, else a cache entry.

    Entries are keyed by the SHA-256 of the bytes prepare reads (the model file and the slices
    of its external data files: :func:`content_key`), so a changed source gets a new entry and
    an unchanged one is reused by every later pool and process. The entry a build publishes is
    keyed by the digest prepare computed over the very bytes it copied, not by the lookup's:
    a source changed between the two (a deploy in progress) lands under its own key, never
    under the old content's. A stamp of the source files spares parsing and hashing them again
    while they are unchanged (see :mod:`sharedml.cache._stamps`).

    Args:
        model_path: Any ONNX model.
        cache_dir: The cache folder: a path, a :class:`sharedml.cache.Cache`, or None for
            :func:`sharedml.cache_dir`.
        size_threshold_bytes: Passed to :func:`sharedml.prepare`; part of the cache key.
        verify: Check every file of the entry against the SHA-256 recorded when it was built
            (a stamp spares re-reading unchanged files); False checks the graph only (the
            weights' size is always checked). A damaged entry is built again, with a warning.
        copy_prepared: Give a model that :func:`sharedml.prepare` wrote a cache entry too,
            instead of returning it as it is: for a model on a network file system, whose
            weights should be mapped from local disk (the copy is prepared from it, so it is
            read twice the first time: once to key it, once to copy it).

    Returns:
        ``model_path`` when :func:`sharedml.prepare` wrote it (and ``copy_prepared`` is
        False), else ``<cache>/models/<key>/model.onnx``.

    Raises:
        ModelError: from :func:`sharedml.prepare`: the model or its external data is unusable.
        CacheError: the cache folder fails sharedml's permission policy, or an entry cannot be
            published (a full disk: the message names the folder).

    Thread and process safety: safe to call from many threads and processes at once; every
    caller gets a complete entry, and no entry is ever modified after it is published.
    """
    path = Path(model_path)
    cache = Cache.at(cache_dir)  # resolved once, for every step below
    size_threshold_bytes = check_threshold(size_threshold_bytes)
    # A copied prepared model must not be found by a later call that wants the model itself.
    params = f"{_KEY_VERSION}:{size_threshold_bytes}{':copy' if copy_prepared else ''}"
    checked: bool | tuple[str, ...] = True if verify else (_PREPARED_NAME,)

    def entry_for(key: str) -> Path:
        entry = ensure_entry(
            "models",
            key,
            lambda tmp: _prepare_into(path, tmp, size_threshold_bytes, cache),
            cache=cache,
            verify=checked,
        )
        # The caller gets a path, and holds the entry only once it maps it: until then the
        # entry stays held here, so that a 'sharedml cache clear' cannot remove it meanwhile.
        lend_hold(entry)
        return entry.file(_PREPARED_NAME)

    known = recall_stamp("prepared", path, params, cache=cache)
    if known is not None:  # the source is unchanged since it was hashed: skip parse and hash
        return entry_for(known)
    before = snapshot(path)  # before the read: a stamp must not vouch for a later write
    model, model_bytes = read_model(path)
    if read_manifest(model) is not None and not copy_prepared:
        return path
    key, before = _source_key(path, model, model_bytes, before, size_threshold_bytes)
    del model, model_bytes  # the graph can be large; prepare loads its own copy
    # A source with inline weights was read and parsed whole (twice its size): glibc keeps
    # those pages in the heap unless trimmed, and every pool's process would carry them.
    _host.release_freed_heap()
    prepared = entry_for(key)
    # Recorded only if no file changed since `before`: else the build may hold other bytes.
    record_stamp("prepared", before, key, params, cache=cache)
    return prepared


def _prepare_into(
    src: Path,
    folder: Path,
    size_threshold_bytes: int,
    cache: Cache,
    *,
    source: str | None = None,
) -> Built:
    """Prepare ``src`` into the entry being built in ``folder``, sharing what others hold.

    ``source`` is what the entry records as its source (default: ``src``'s absolute path, so
    that ``sharedml cache list`` names it from any folder).
    """
    try:
        result = prepare(src, folder / _PREPARED_NAME, size_threshold_bytes=size_threshold_bytes)
    except OutputError as exc:
        raise CacheError(
            f"Could not build the cache entry for '{src}': {exc} Or set SHAREDML_CACHE_DIR to a "
            "folder with room."
        ) from exc
    from sharedml.prepared._dedupe import share_with_entries  # it builds on this module

    # Tensors that other entries hold already are linked, not stored again
    # (sharedml.prepared._dedupe).
    dedupe = share_with_entries(folder, _PREPARED_NAME, cache)
    return Built(
        meta={
            "source": source if source is not None else str(src.absolute()),
            "tensors_moved": result.tensors_moved,
            "bytes": result.bytes_moved,
            **dedupe.meta,
        },
        sha256=dedupe.sha256,
        key=_key_of(result.source_sha256, size_threshold_bytes),
    )


def prepared_model_from_bytes(
    data: bytes,
    *,
    cache_dir: CacheDir = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    verify: bool = True,
) -> Path:
    """A prepared model for a model given as bytes (as ``InferenceSession`` accepts it).

    The entry is keyed as prepare keys what it reads (:func:`content_key`): the same model
    given by path or as bytes finds the same entry. A model in bytes has no folder, so it
    cannot refer to external data files.

    Raises:
        InvalidModelError: the bytes are not an ONNX model.
        ExternalDataError: the model refers to external data files.
        CacheError: the cache folder fails sharedml's permission policy.
    """
    cache = Cache.at(cache_dir)  # resolved once, for every step below
    size_threshold_bytes = check_threshold(size_threshold_bytes)
    try:
        model = parse_model(data)
    except Exception as exc:
        raise InvalidModelError(f"The model bytes are not a valid ONNX model: {exc}") from None
    if not model.HasField("graph"):
        raise InvalidModelError("The model bytes are not a valid ONNX model: it has no graph.")
    if read_manifest(model) is not None:
        raise InvalidModelError(
            "The model bytes are a prepared model's graph, whose weights live in a file beside "
            "it: pass the prepared model's path instead."
        )
    locations = external_locations(model.graph)
    if locations:
        names = ", ".join(sorted(locations))
        raise ExternalDataError(
            f"The model given as bytes refers to external data files ({names}), which bytes "
            "cannot carry: pass the model's path instead."
        )
    del model
    reader = _SourceReader(data)  # no external slice to read: the digest is the bytes'
    key = _key_of(reader.hexdigest(), size_threshold_bytes)
    reader.close()

    def build(folder: Path) -> Built:
        source = folder / "source.onnx"
        source.write_bytes(data)
        try:
            return _prepare_into(source, folder, size_threshold_bytes, cache, source=_BYTES_SOURCE)
        finally:
            source.unlink()

    checked: bool | tuple[str, ...] = True if verify else (_PREPARED_NAME,)
    entry = ensure_entry("models", key, build, cache=cache, verify=checked)
    lend_hold(entry)  # as prepared_model_for does
    return entry.file(_PREPARED_NAME)
