"""Rewrite a model so that every weight lives in one aligned, memory-mappable file.

``prepare(src, dst)`` writes ``dst`` (the graph: small) and ``<dst stem>.weights`` beside it.
Every tensor of at least ``size_threshold_bytes`` moves into the weights file, wherever it was
in the source: an initializer stored inline or in external data files, a ``Constant`` node
(turned into an initializer of the same graph, as ORT itself does at load), or either of those
inside ``If``/``Loop``/``Scan`` bodies at any depth. Each tensor starts at a multiple of
``alignment_bytes`` so that a mapping of the file hands ORT aligned buffers.

The data is streamed: external tensors are copied in chunks, so peak memory is about one chunk
plus the graph, not the model's size. Models over 2 GB arrive with external data and prepare
the same way. The outputs appear atomically (temporary files, then ``os.replace``), and the
source model and its data files are only ever read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import onnx
from onnx import ModelProto, TensorProto

from sharedml import _host
from sharedml._cache import Built, CacheDir, ensure_entry, recall_stamp, record_stamp
from sharedml._errors import ExternalDataError, InvalidModelError, PrepareError, UnsafePathError
from sharedml._host import fsync_dir
from sharedml._onnx import (
    Placement,
    external_locations,
    inline_bytes,
    is_external,
    iter_tensors,
    load_graph,
    resolve_external,
    set_external,
    tensor_nbytes,
)

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "DEFAULT_SIZE_THRESHOLD_BYTES",
    "MANIFEST_KEY",
    "PrepareResult",
    "WeightsManifest",
    "WeightsPlan",
    "content_key",
    "load_graph",
    "plan_weights",
    "prepare",
    "prepared_model_for",
    "prepared_model_from_bytes",
    "read_manifest",
    "weights_path_for",
]

DEFAULT_ALIGNMENT_BYTES = 4096  # bytes: one page, so every tensor can be mapped on its own
DEFAULT_SIZE_THRESHOLD_BYTES = 1024  # bytes: what onnx's own external-data helpers use
MANIFEST_KEY = "sharedml.weights"  # metadata_props key of the prepared model
_FORMAT_VERSION = 1
_CHUNK_BYTES = 16 * 1024 * 1024  # bytes copied at a time: bounds prepare's peak memory
# Tensors under this many bytes always stay inline, whatever the threshold: shape inference at
# load must read small constant inputs (Reshape's shape, Slice's starts) from the graph, and ORT
# copies external tensors this small into the graph at load anyway.
_ALWAYS_INLINE_BYTES = 128

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` while the weights file is written."""


@dataclasses.dataclass(frozen=True)
class WeightsManifest:
    """What a prepared model records about its weights file, to verify it at load.

    Attributes:
        file: The weights file's name, relative to the model's folder.
        size_bytes: Its exact size.
        sha256: Hex SHA-256 of its whole content.
        alignment_bytes: The alignment every tensor offset honours.
        tensors: How many tensors the file holds.
    """

    file: str
    size_bytes: int
    sha256: str
    alignment_bytes: int
    tensors: int

    def to_json(self) -> str:
        """Serialize as stored in the model's ``metadata_props``."""
        return json.dumps({"format": _FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WeightsManifest:
        """Parse the stored form; raises ``InvalidModelError`` when malformed."""
        try:
            raw = json.loads(text)
            if raw.pop("format") != _FORMAT_VERSION:
                raise ValueError("unknown format version")
            manifest = cls(**raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidModelError(f"Malformed {MANIFEST_KEY} metadata: {exc}") from None
        if Path(manifest.file).name != manifest.file:
            raise UnsafePathError(
                f"The prepared model names weights file {manifest.file!r}, which is not a plain "
                "file name in the model's folder."
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
        tensors_inline: Tensors left in the graph (below the threshold, or strings).
        bytes_inline: Their data size.
        constants_converted: ``Constant`` nodes turned into initializers.
        manifest: The record stored in the model to verify the weights file.
    """

    model_path: Path
    weights_path: Path
    tensors_moved: int
    bytes_moved: int
    tensors_inline: int
    bytes_inline: int
    constants_converted: int
    manifest: WeightsManifest

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
    """Where a tensor's bytes come from: a slice of a file, or bytes in the graph."""

    tensor: TensorProto
    nbytes: int
    file: Path | None = None
    offset: int = 0


@dataclasses.dataclass
class WeightsPlan:
    """What prepare will do to a model, computed from its protobuf before any I/O.

    Attributes:
        moving: The tensors that go to the weights file, in the order they are written.
        inline_tensors: Tensors left in the graph (below the threshold, or strings).
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


def _source_of(tensor: TensorProto, model_path: Path) -> _Source | None:
    if is_external(tensor):
        piece = resolve_external(tensor, model_path)
        return _Source(tensor=tensor, nbytes=piece.length, file=piece.file, offset=piece.offset)
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
            onnx.numpy_helper.to_array(tensor)
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
    # Initializers that are not graph inputs need IR version 4; older models keep their Constants.
    may_convert = model.ir_version >= 4
    for ref in list(iter_tensors(model.graph)):
        tensor = ref.tensor
        if ref.placement is Placement.CONSTANT:
            assert ref.node is not None
            if not may_convert or len(ref.node.output) != 1:
                continue
            size = (
                resolve_external(tensor, model_path).length
                if is_external(tensor)
                else tensor_nbytes(tensor)
            )
            if size is None or size < floor:
                continue
            tensor = ref.graph.initializer.add()
            tensor.CopyFrom(ref.tensor)
            tensor.name = ref.name
            ref.graph.node.remove(ref.node)
            converted += 1
        elif ref.placement is not Placement.INITIALIZER:
            continue
        src = _source_of(tensor, model_path)
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
        if pad:
            self.write(b"\0" * pad)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _write_weights(
    moving: list[_Source],
    writer: _HashingWriter,
    location: str,
    alignment: int,
    progress: ProgressCallback | None,
) -> None:
    total = sum(src.nbytes for src in moving)
    done = 0
    placed: dict[tuple[Path, int, int], int] = {}  # tied weights are written once
    handles: dict[Path, IO[bytes]] = {}
    try:
        for src in moving:
            key = (src.file, src.offset, src.nbytes) if src.file is not None else None
            if key is not None and key in placed:
                set_external(src.tensor, location, placed[key], src.nbytes)
                done += src.nbytes
                continue
            writer.pad_to(alignment)
            start = writer.position
            if src.file is None:
                data = inline_bytes(src.tensor)
                writer.write(data)
                del data
            else:
                fh = handles.get(src.file)
                if fh is None:
                    fh = handles[src.file] = open(src.file, "rb")  # noqa: SIM115 - closed below
                fh.seek(src.offset)
                remaining = src.nbytes
                while remaining:
                    chunk = fh.read(min(_CHUNK_BYTES, remaining))
                    if not chunk:
                        raise ExternalDataError(
                            f"External data file '{src.file}' ended early while reading tensor "
                            f"'{src.tensor.name}'."
                        )
                    writer.write(chunk)
                    remaining -= len(chunk)
                    if progress is not None:
                        progress(done + src.nbytes - remaining, total)
                placed[key] = start  # type: ignore[index]
            set_external(src.tensor, location, start, src.nbytes)
            done += src.nbytes
            if progress is not None:
                progress(done, total)
        # A file ending on the alignment keeps `size` a multiple of a page for mmap users.
        writer.pad_to(alignment)
    finally:
        for fh in handles.values():
            fh.close()


def _replace_metadata(model: ModelProto, manifest: WeightsManifest) -> None:
    keep = [p for p in model.metadata_props if p.key != MANIFEST_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    entry = model.metadata_props.add()
    entry.key, entry.value = MANIFEST_KEY, manifest.to_json()


def _create_temp(final: Path) -> tuple[int, Path]:
    """A new temporary file beside ``final``, with the permissions the umask gives new files.

    (``tempfile.mkstemp`` would make it 0600, so a prepared model would be unreadable by the
    other users a deployment often runs its workers as.)
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        path = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise PrepareError(f"Could not create a temporary file beside '{final}'.")  # pragma: no cover


def prepare(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    progress: ProgressCallback | None = None,
) -> PrepareResult:
    """Rewrite ``src`` into ``dst`` plus one aligned weights file beside it.

    Args:
        src: Any ONNX model: weights inline, in external data files, in ``Constant`` nodes or
            in subgraphs. A model prepared before prepares again into an equivalent one.
        dst: The graph file to write. The weights go to ``<dst stem>.weights`` in its folder,
            which is created if missing. Existing files at both paths are replaced atomically.
        size_threshold_bytes: Tensors at least this large move to the weights file; smaller
            ones stay in the graph (and those under 128 bytes always do: shape inference must
            read them). Tensors that were in external files always move.
        alignment_bytes: Every tensor's offset is a multiple of this (a power of two, at least
            4096 so that each tensor can be mapped on its own).
        progress: Called as ``progress(bytes_done, bytes_total)`` while weights are copied.

    Returns:
        A :class:`PrepareResult` describing what was written.

    Raises:
        ModelNotFoundError: ``src`` does not exist.
        InvalidModelError: ``src`` is not a valid ONNX model.
        ExternalDataError: external data is missing, truncated, overlapping or malformed.
        UnsafePathError: an external data location points outside ``src``'s folder.
        PrepareError: ``dst`` or its weights file would overwrite the source or its data.

    Thread safety: safe to call concurrently, also on the same ``dst`` (the last one wins,
    each result complete).
    """
    src_path = Path(src)
    dst_path = Path(dst)
    if alignment_bytes < 4096 or alignment_bytes & (alignment_bytes - 1):
        raise ValueError(f"alignment_bytes must be a power of two >= 4096, not {alignment_bytes}.")
    if size_threshold_bytes < 0:
        raise ValueError("size_threshold_bytes must not be negative.")
    model = load_graph(src_path)
    weights_path = weights_path_for(dst_path)
    if _same_file(src_path, dst_path):
        raise PrepareError(
            f"prepare would overwrite its source model '{src_path}'. Write the prepared model to "
            "another path (e.g. -o model.prepared.onnx)."
        )

    plan = plan_weights(model, src_path, size_threshold_bytes)
    moving = plan.moving
    for source_file in {s.file for s in moving if s.file is not None}:
        if _same_file(source_file, weights_path):
            raise PrepareError(
                f"prepare would overwrite '{weights_path}', which holds the source model's "
                f"external data. Write the prepared model elsewhere."
            )

    dst_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_weights = tmp_model = None
    try:
        fd, tmp_weights = _create_temp(weights_path)
        with os.fdopen(fd, "wb") as fh:
            writer = _HashingWriter(fh)
            _write_weights(moving, writer, weights_path.name, alignment_bytes, progress)
            fh.flush()
            os.fsync(fh.fileno())
        manifest = WeightsManifest(
            file=weights_path.name,
            size_bytes=writer.position,
            sha256=writer.sha.hexdigest(),
            alignment_bytes=alignment_bytes,
            tensors=len(moving),
        )
        _replace_metadata(model, manifest)
        fd, tmp_model = _create_temp(dst_path)
        with os.fdopen(fd, "wb") as fh:
            fh.write(model.SerializeToString())
            fh.flush()
            os.fsync(fh.fileno())
        # Weights first: until the graph lands, no prepared model refers to the new weights; an
        # older graph left at dst by a crash in between is caught by its recorded hash.
        os.replace(tmp_weights, weights_path)
        tmp_weights = None
        os.replace(tmp_model, dst_path)
        tmp_model = None
        fsync_dir(dst_path.parent)
    finally:
        for leftover in (tmp_weights, tmp_model):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    leftover.unlink()

    return PrepareResult(
        model_path=dst_path,
        weights_path=weights_path,
        tensors_moved=len(moving),
        bytes_moved=plan.moving_bytes,
        tensors_inline=plan.inline_tensors,
        bytes_inline=plan.inline_bytes,
        constants_converted=plan.constants_converted,
        manifest=manifest,
    )


# --------------------------------------------------------------------------------------------
# Prepared once per content: the cache's ``models`` entries

_KEY_VERSION = "1"  # bump when prepare's output format changes
_PREPARED_NAME = "model.onnx"


def _content_key(
    path: Path, model: ModelProto, size_threshold_bytes: int
) -> tuple[str, list[Path]]:
    """The entry key, and the external data files it covers (existing or not)."""
    sha = hashlib.sha256(f"sharedml-cache:{_KEY_VERSION}:{size_threshold_bytes}\n".encode())
    _host.sha256_file(path, sha)
    base = Path(os.path.realpath(path.parent))
    covered: list[Path] = []
    for location in sorted(external_locations(model.graph)):
        sha.update(f"\n{location}\n".encode())
        try:
            target = Path(os.path.realpath(base / location))
            inside = os.path.commonpath([base, target]) == str(base)
        except ValueError:  # NUL bytes, other drives: prepare reports these with its errors
            continue
        # Unsafe or missing locations are prepare's to report, with its clear errors.
        if inside:
            covered.append(target)
            if target.is_file():
                _host.sha256_file(target, sha)
    return sha.hexdigest(), covered


def content_key(model_path: str | os.PathLike[str], *, size_threshold_bytes: int) -> str:
    """SHA-256 over the model file, its external data files and the prepare settings."""
    path = Path(model_path)
    return _content_key(path, load_graph(path), size_threshold_bytes)[0]


def prepared_model_for(
    model_path: str | os.PathLike[str],
    *,
    cache_dir: CacheDir = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    verify: bool = True,
    copy_prepared: bool = False,
) -> Path:
    """A prepared model equivalent to ``model_path``: itself if prepared, else a cache entry.

    Entries are keyed by the SHA-256 of the model file and of every external data file it
    refers to, so a changed source gets a new entry and an unchanged one is reused by every
    later pool and process. A stamp of the source files spares parsing and hashing them again
    while they are unchanged (see :mod:`sharedml._cache`).

    Args:
        model_path: Any ONNX model.
        cache_dir: The cache folder (default: :func:`sharedml.cache_dir`).
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
            published.

    Thread and process safety: safe to call from many threads and processes at once; every
    caller gets a complete entry, and no entry is ever modified after it is published.
    """
    path = Path(model_path)
    # A copied prepared model must not be found by a later call that wants the model itself.
    params = f"{_KEY_VERSION}:{size_threshold_bytes}{':copy' if copy_prepared else ''}"
    checked: bool | tuple[str, ...] = True if verify else (_PREPARED_NAME,)

    def entry_for(key: str) -> Path:
        entry = ensure_entry(
            "models",
            key,
            lambda tmp: _prepare_into(path, tmp, size_threshold_bytes),
            cache_dir=cache_dir,
            verify=checked,
        )
        return entry.file(_PREPARED_NAME)

    known = recall_stamp("prepared", path, params, cache_dir=cache_dir)
    if known is not None:  # the source is unchanged since it was hashed: skip parse and hash
        return entry_for(known)
    model = load_graph(path)
    if read_manifest(model) is not None and not copy_prepared:
        return path
    key, covered = _content_key(path, model, size_threshold_bytes)
    del model  # the graph can be large; prepare loads its own copy
    prepared = entry_for(key)
    record_stamp("prepared", path, key, params, companions=covered, cache_dir=cache_dir)
    return prepared


def _prepare_into(src: Path, folder: Path, size_threshold_bytes: int) -> Built:
    result = prepare(src, folder / _PREPARED_NAME, size_threshold_bytes=size_threshold_bytes)
    return Built(
        meta={"source": str(src), "tensors": result.tensors_moved, "bytes": result.bytes_moved},
        sha256={result.weights_path.name: result.manifest.sha256},
    )


def prepared_model_from_bytes(
    data: bytes,
    *,
    cache_dir: CacheDir = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    verify: bool = True,
) -> Path:
    """A prepared model for a model given as bytes (as ``InferenceSession`` accepts it).

    The bytes are keyed by their SHA-256 like any other cache entry; a model in bytes has no
    folder, so it cannot refer to external data files.

    Raises:
        InvalidModelError: the bytes are not an ONNX model.
        ExternalDataError: the model refers to external data files.
        CacheError: the cache folder fails sharedml's permission policy.
    """
    try:
        model = onnx.load_model_from_string(data)
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
    sha = hashlib.sha256(f"sharedml-bytes:{_KEY_VERSION}:{size_threshold_bytes}\n".encode())
    sha.update(data)

    def build(folder: Path) -> Built:
        source = folder / "source.onnx"
        source.write_bytes(data)
        try:
            return _prepare_into(source, folder, size_threshold_bytes)
        finally:
            source.unlink()

    checked: bool | tuple[str, ...] = True if verify else (_PREPARED_NAME,)
    entry = ensure_entry("models", sha.hexdigest(), build, cache_dir=cache_dir, verify=checked)
    return entry.file(_PREPARED_NAME)
