"""``prepare``: rewrite a model so that every weight lives in one aligned, memory-mappable file.

``prepare(src, dst)`` writes ``dst`` (the graph: small) and ``<dst stem>.weights`` beside it:
the plan (:mod:`sharedml.prepared._plan`) says which tensors move, the source is read once and
hashed (:mod:`sharedml.prepared._source`), the weights file is written by the format's rule
(:mod:`sharedml.prepared._format`), and the outputs land atomically (temporary files, then
``os.replace``: :mod:`sharedml.prepared._files`), read-only, and never over the source model or
its data files. Models over 2 GB arrive with external data and prepare the same way.

The cache's ``models`` entries (:func:`prepared_model_for`) are prepared here too, once per
content: keyed by the digest of exactly the source bytes prepare read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sharedml._errors import (
    CacheError,
    ExternalDataError,
    InvalidModelError,
    OutputError,
    PrepareError,
    SharedMLError,
)
from sharedml._host import _platform
from sharedml._host._files import fsync_dir
from sharedml.cache._entries import Built, ensure_entry
from sharedml.cache._locks import lend_hold
from sharedml.cache._root import Cache, CacheDir
from sharedml.cache._stamps import Snapshot, recall_stamp, record_stamp, snapshot
from sharedml.model._graph import external_locations, read_model, set_external
from sharedml.model._proto import ModelProto, parse_model
from sharedml.prepared._dedupe import share_with_entries
from sharedml.prepared._files import (
    check_outputs,
    create_temp,
    keep_a_link,
    output_error,
    remove_dead_temps,
    replace_output,
    source_files,
    write_temp,
)
from sharedml.prepared._format import (
    DEFAULT_ALIGNMENT_BYTES,
    ProgressCallback,
    SharedWeights,
    WeightsManifest,
    WeightsWriter,
    read_manifest,
    weights_path_for,
    write_manifest,
)
from sharedml.prepared._plan import (
    DEFAULT_SIZE_THRESHOLD_BYTES,
    TensorSource,
    check_settings,
    check_threshold,
    plan_weights,
)
from sharedml.prepared._source import SourceReader, hash_sources, reads

__all__ = [
    "PrepareResult",
    "SharedWeights",
    "WeightsManifest",
    "content_key",
    "output_paths",
    "prepare",
    "prepared_model_for",
    "prepared_model_from_bytes",
    "prepared_model_with_graph",
    "weights_path_for",
]
# SharedWeights, WeightsManifest and weights_path_for live in sharedml.prepared._format; they are
# named here too because the package's public face looks them up in this module.


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


def _write_weights(
    moving: list[TensorSource],
    writer: WeightsWriter,
    reader: SourceReader,
    progress: ProgressCallback | None,
) -> None:
    """Write the plan's tensors (tied ones once) and point each tensor at its bytes."""
    total = sum(src.nbytes for src in moving)
    done = 0
    placed: dict[int, int] = {}  # plan index -> offset; tied weights are written once

    def reported(chunks: Iterator[bytes]) -> Iterator[bytes]:
        sofar = 0
        for chunk in chunks:
            yield chunk
            sofar += len(chunk)
            if progress is not None:  # once the writer has written the chunk
                progress(done + sofar, total)

    for index, src, earlier in reads(moving):
        if earlier is not None:
            reader.tied(index, earlier)
            start = placed[earlier]
        elif src.piece is None:
            start = writer.add(reader.chunks(index, src), src.nbytes)
        else:
            start = writer.add(reported(reader.chunks(index, src)), src.nbytes)
        placed[index] = start
        set_external(src.tensor, writer.layout.file, start, src.nbytes)
        done += src.nbytes
        if progress is not None:
            progress(done, total)


def output_paths(src_path: Path, dst: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The graph file and the weights file that preparing ``src_path`` to ``dst`` writes.

    An existing folder as ``dst`` means ``<dst>/<src stem>.onnx`` (as ``cp`` does); the weights
    go to ``<graph stem>.weights`` beside the graph.

    Raises:
        PrepareError: ``dst`` is empty, or the graph file would also be the weights file's name.
    """
    if not os.fspath(dst):  # Path("") is ".": the working directory, which nobody named
        raise PrepareError(
            "The output path is empty: name the graph file to write (e.g. -o "
            "prepared/model.onnx), or '.' for the current folder. Nothing was written."
        )
    dst_path = Path(dst)
    if dst_path.is_dir() and not dst_path.is_symlink():
        dst_path = dst_path / f"{src_path.stem}.onnx"
    weights_path = weights_path_for(dst_path)
    if weights_path == dst_path:
        raise PrepareError(
            f"'{dst_path}' is also the name prepare gives the weights file (the graph file's stem "
            "+ '.weights'); name the graph file differently, e.g. "
            f"'{dst_path.with_suffix('.onnx')}'. Nothing was written."
        )
    return dst_path, weights_path


def prepare(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    progress: ProgressCallback | None = None,
) -> PrepareResult:
    """Rewrite ``src`` into ``dst`` plus one aligned weights file beside it.

    Several models that hold the same tensors (a *family*) are prepared over one weights file
    by :func:`sharedml.prepare_family`.

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
        TypeError: ``src`` is a list (:func:`sharedml.prepare_family` prepares several).
        OutputError: the outputs could not be written (a full disk, a folder this user may
            not write, a name too long); it is also an ``OSError`` with the ``errno``.

    Thread safety: safe to call concurrently, also on the same ``dst`` (the last one wins,
    each result complete).
    """
    if isinstance(src, (list, tuple)):
        raise TypeError(
            "sharedml.prepare() prepares one model, and was given a list: call "
            "sharedml.prepare_family(models, folder) to prepare several over one weights file."
        )
    check_settings(size_threshold_bytes, alignment_bytes)
    src_path = Path(src)
    dst_path, weights_path = output_paths(src_path, dst)
    model, model_bytes = read_model(src_path)
    reader = SourceReader(model_bytes)
    del model_bytes
    # Inputs are the source model and every external data file it names (moved or not):
    # writing over one destroys the source (``prepare("model.onnx", "model.onnx.data")``).
    check_outputs(
        (dst_path, weights_path),
        source_files(src_path, model.graph),
        writer="prepare",
        fix="write the prepared model to another path (e.g. -o model.prepared.onnx)",
    )
    plan = plan_weights(model, src_path, size_threshold_bytes)
    layout = WeightsManifest(weights_path.name, 0, "", alignment_bytes, len(plan.moving))

    writing = dst_path.parent  # what an OSError below failed to write, for its message
    tmp_weights = tmp_model = None
    try:
        dst_path.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(dst_path.parent)
        writing = weights_path
        fd, tmp_weights = create_temp(weights_path)
        with os.fdopen(fd, "wb") as fh:
            writer = WeightsWriter(fh, layout)
            _write_weights(plan.moving, writer, reader, progress)
            manifest = writer.finish()
        write_manifest(model, manifest)
        writing = dst_path
        tmp_model = write_temp(dst_path, model.SerializeToString())
        # Weights first: until the graph lands, no prepared model refers to the new weights; an
        # older graph left at dst by a crash in between is caught by its recorded hash. If the
        # graph cannot land, the weights file that was there is put back (a hard link kept it).
        backup = keep_a_link(weights_path)
        try:
            writing = weights_path
            replace_output(tmp_weights, weights_path)
            tmp_weights = None
            try:
                writing = dst_path
                replace_output(tmp_model, dst_path)
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
        raise output_error(writing, exc) from exc
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
    reader = SourceReader(model_bytes)
    plan = plan_weights(model, path, size_threshold_bytes)
    named = [
        path.parent / location
        for location in sorted(external_locations(model.graph))
        if "\0" not in location
    ]
    before = before.extended(named)
    try:
        hash_sources(plan.moving, reader)
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
    return prepared_model_with_graph(
        model_path,
        cache_dir=cache_dir,
        size_threshold_bytes=size_threshold_bytes,
        verify=verify,
        copy_prepared=copy_prepared,
    )[0]


def prepared_model_with_graph(
    model_path: str | os.PathLike[str],
    *,
    cache_dir: CacheDir = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    verify: bool = True,
    copy_prepared: bool = False,
) -> tuple[Path, ModelProto | None]:
    """:func:`prepared_model_for`, and the prepared graph where finding it parsed that graph.

    A model that :func:`sharedml.prepare` wrote is read to find its manifest: that parse is
    the prepared graph, returned so that the caller does not parse the file again. A cache
    entry is not parsed here (the source was, or a stamp spared it): None.
    """
    path = Path(model_path)
    size_threshold_bytes = check_threshold(size_threshold_bytes)
    # A copied prepared model must not be found by a later call that wants the model itself.
    params = f"{_KEY_VERSION}:{size_threshold_bytes}{':copy' if copy_prepared else ''}"
    checked: bool | tuple[str, ...] = True if verify else (_PREPARED_NAME,)
    cache = Cache.at(cache_dir)  # resolved once, for every step below

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
        return entry_for(known), None
    before = snapshot(path)  # before the read: a stamp must not vouch for a later write
    model, model_bytes = read_model(path)
    if read_manifest(model) is not None and not copy_prepared:
        return path, model
    key, before = _source_key(path, model, model_bytes, before, size_threshold_bytes)
    del model, model_bytes  # the graph can be large; prepare loads its own copy
    # A source with inline weights was read and parsed whole (twice its size): glibc keeps
    # those pages in the heap unless trimmed, and every pool's process would carry them.
    _platform.release_freed_heap()
    prepared = entry_for(key)
    # Recorded only if no file changed since `before`: else the build may hold other bytes.
    record_stamp("prepared", before, key, params, cache=cache)
    return prepared, None


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
    reader = SourceReader(data)  # no external slice to read: the digest is the bytes'
    cache = Cache.at(cache_dir)  # resolved once, for every step below
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
