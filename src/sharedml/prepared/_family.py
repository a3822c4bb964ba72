"""Model families: several graphs that hold the same tensors, prepared over ONE weights file.

``prepare_family([a, b, c], folder)`` writes ``folder/<a's name>``, ``folder/<b's name>``, ...
and one weights file, ``folder/family-<sha16>.weights``, that holds each *distinct* tensor once. Two
tensors are one tensor when their dtype, shape, length and SHA-256 of their bytes are equal
(:class:`TensorDigest`), whatever their names and wherever they sat (an initializer, a
``Constant``, a subgraph, an external file): Optimum's ``decoder_model.onnx`` and
``decoder_with_past_model.onnx``, or an encoder exported once per task head, then cost one
copy on disk and, through :class:`sharedml.weights.WeightStore` (which maps each weights *file* once
per process, whichever graph names it), one copy in memory.

Each graph is an ordinary prepared model (manifest format 2, one weights file), so every route
and tool that reads prepared models reads a family member unchanged.

Redeploying: the weights file is named by its content, so a new content never overwrites a
file a running pool maps. Graphs land by ``os.replace``; afterwards, ``family-*.weights`` files
of the folder that no ``*.onnx`` in it refers to are removed (a pool that still maps one keeps
its pages: an unlinked mapping survives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sharedml._errors import (
    FamilyError,
    ModelNotFoundError,
    PrepareError,
    SharedMLError,
)
from sharedml._host._files import fsync_dir
from sharedml._host._hashing import HashingWriter
from sharedml.model._graph import (
    ExternalData,
    iter_tensors,
    load_graph,
    read_model,
    set_external,
)
from sharedml.model._proto import ModelProto, TensorProto
from sharedml.prepared._files import (
    SourceFile,
    check_outputs,
    create_temp,
    output_error,
    remove_dead_temps,
    replace_output,
    source_files,
    write_temp,
)
from sharedml.prepared._format import (
    DEFAULT_ALIGNMENT_BYTES,
    ProgressCallback,
    TensorDigest,
    WeightsManifest,
    WeightsWriter,
    digest_of,
    file_matches,
    read_manifest,
    write_manifest,
)
from sharedml.prepared._plan import DEFAULT_SIZE_THRESHOLD_BYTES, check_settings, plan_weights
from sharedml.prepared._source import SourceReader

__all__ = ["FAMILY_WEIGHTS_PATTERN", "FamilyResult", "TensorDigest", "prepare_family"]
# TensorDigest lives in sharedml.prepared._format; the package's public face looks it up here.

# The names prepare gives a family's weights file: the first 16 hex digits of its SHA-256.
# Only files named so are ever removed by prepare (a user's own files in the folder are not).
FAMILY_WEIGHTS_PATTERN = re.compile(r"family-[0-9a-f]{16}\.weights")


@dataclasses.dataclass(frozen=True)
class FamilyResult:
    """What :func:`prepare_family` wrote.

    Attributes:
        model_paths: The prepared graphs, in the order of the sources.
        weights_path: The one weights file they share.
        tensors_total: Tensors moved out of all graphs, counted per graph.
        tensors_distinct: Distinct tensors (by :class:`TensorDigest`) in the weights file.
        bytes_total: Their data, counted per graph: what separate prepares would store.
        bytes_distinct: Data bytes of the distinct tensors (without padding).
        manifest: The record every graph carries (one file: the same record in each).
        removed: ``family-*.weights`` files of the folder that no graph refers to any more,
            removed after the graphs landed.
    """

    model_paths: tuple[Path, ...]
    weights_path: Path
    tensors_total: int
    tensors_distinct: int
    bytes_total: int
    bytes_distinct: int
    manifest: WeightsManifest
    removed: tuple[Path, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``sharedml prepare A B -o DIR --json`` prints)."""
        return {
            "model_paths": [str(p) for p in self.model_paths],
            "weights_path": str(self.weights_path),
            "tensors_total": self.tensors_total,
            "tensors_distinct": self.tensors_distinct,
            "bytes_total": self.bytes_total,
            "bytes_distinct": self.bytes_distinct,
            "weights_file_bytes": self.manifest.size_bytes,
            "weights_sha256": self.manifest.sha256,
            "removed": [str(p) for p in self.removed],
        }


class _DedupingWriter:
    """Appends tensors to a weights file; a tensor already in the file is rolled back.

    The file's SHA-256 runs along (:class:`sharedml.prepared._format.WeightsWriter`): a tensor
    that turns out to be known is forgotten with its padding, so the file is never read back
    to hash it.
    """

    def __init__(self, writer: WeightsWriter) -> None:
        self.writer = writer
        self.offsets: dict[TensorDigest, int] = {}

    def add(
        self, tensor: TensorProto, chunks: Iterable[bytes | memoryview], length: int
    ) -> tuple[int, bool]:
        """Write one tensor's ``chunks``; returns (its offset, whether it was new)."""
        mark = self.writer.mark()
        content = HashingWriter()  # to nowhere: the tensor's own digest
        offset = self.writer.add(content.through(chunks), length)
        key = digest_of(tensor, content)
        known = self.offsets.get(key)
        if known is not None:  # already in the file: forget what was just written
            self.writer.rollback(mark)
            return known, False
        self.offsets[key] = offset
        return offset, True


def _check_members(sources: Sequence[Path], out_dir: Path) -> list[SourceFile]:
    """Refuse clashing names, missing members and members inside the output folder.

    Returns:
        Every file the members are made of (:func:`~sharedml.prepared._files.source_files`).

    Raises:
        FamilyError, ModelNotFoundError, PrepareError: before anything is written.
    """
    if not sources:
        raise FamilyError("prepare was given an empty list of models: name at least one.")
    seen: dict[str, Path] = {}
    for src in sources:
        other = seen.setdefault(src.name, src)
        if other is not src:
            raise FamilyError(
                f"Two members of the family have the file name '{src.name}' ('{other}' and "
                f"'{src}'): both would be written to the same path in the output folder. "
                "Rename one of them. Nothing was written."
            )
    for src in sources:
        if not src.is_file():
            raise ModelNotFoundError(
                f"Family member '{src}' does not exist (or is not a file). Nothing was written."
            )
    if out_dir.exists() and (out_dir.is_symlink() or not out_dir.is_dir()):
        raise PrepareError(
            f"The output of a family, '{out_dir}', must be a folder (not a file or a symlink). "
            "Nothing was written."
        )
    real_out = os.path.realpath(out_dir)
    every: list[SourceFile] = []
    for src in sources:
        files = source_files(src, load_graph(src).graph)
        for path, _ in files:
            real = os.path.realpath(path)
            if os.path.commonpath([real_out, real]) == real_out:
                what = "is" if path == src else f"has external data '{path}', which is"
                raise FamilyError(
                    f"Family member '{src}' {what} inside the output folder '{out_dir}': "
                    "prepare would write over its own source. Write the family to another "
                    "folder. Nothing was written."
                )
        every += files
    return every


def _referenced(folder: Path) -> set[str] | None:
    """Weights file names that the ``*.onnx`` files of ``folder`` refer to; None if unsure."""
    names: set[str] = set()
    for graph in folder.glob("*.onnx"):
        try:
            manifest = read_manifest(load_graph(graph))
        except SharedMLError:
            return None  # an unreadable graph might refer to anything: remove nothing
        if manifest is not None:
            names.update(f.file for f in manifest.files)
    return names


def _remove_unreferenced(folder: Path, keep: str) -> tuple[Path, ...]:
    referenced = _referenced(folder)
    if referenced is None:
        return ()
    removed = []
    for path in sorted(folder.iterdir()):
        name = path.name
        if name == keep or name in referenced or not FAMILY_WEIGHTS_PATTERN.fullmatch(name):
            continue
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
                removed.append(path)
    return tuple(removed)


def _only_ours(path: Path) -> bool:
    """Whether ``path`` is this user's, nobody else may write it, and it has one link."""
    if os.name != "posix":
        return True
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        and st.st_nlink == 1
    )


def prepare_family(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
    progress: ProgressCallback | None = None,
) -> FamilyResult:
    """Prepare several models into ``out_dir`` over one weights file of distinct tensors.

    A *family* is graphs that hold the same tensors under any names. Each model is written to
    ``out_dir/<its file name>``, all of them over ONE weights file,
    ``out_dir/family-<sha16>.weights``, that holds each distinct tensor (same dtype, shape and
    SHA-256 of its bytes) once. Each graph is an ordinary prepared model.

    Args:
        models: The members: ONNX models, as :func:`sharedml.prepare` takes them.
        out_dir: The folder to write into (created if missing).
        size_threshold_bytes: As :func:`sharedml.prepare`.
        alignment_bytes: As :func:`sharedml.prepare`.
        progress: Called as ``progress(bytes_done, bytes_total)`` while weights are copied.

    Returns:
        A :class:`FamilyResult` describing what was written.

    Raises:
        FamilyError: no models, two models share a file name, or a model (or its external
            data) is inside ``out_dir``.
        ModelNotFoundError: a model does not exist.
        PrepareError, OutputError, ModelError: as :func:`sharedml.prepare`. Every check runs
            before anything is written; a failure while writing leaves no new file behind.

    Thread safety: safe to call concurrently on different folders.
    """
    check_settings(size_threshold_bytes, alignment_bytes)
    paths = [Path(s) for s in models]
    if not os.fspath(out_dir):  # Path("") is ".": the working directory, which nobody named
        raise PrepareError(
            "The output folder is empty: name the folder to write the family into (e.g. -o "
            "prepared/), or '.' for the current folder. Nothing was written."
        )
    folder = Path(out_dir)
    sources = _check_members(paths, folder)
    check_outputs(
        [folder / src.name for src in paths],
        sources,
        writer="prepare",
        fix="write the family to another folder",
    )
    placeholder = "family.weights"  # the real name is known once the content is
    layout = WeightsManifest(placeholder, 0, "", alignment_bytes, 0)

    writing = folder
    tmp_weights: Path | None = None
    tmp_graphs: list[Path] = []
    graphs: list[ModelProto] = []
    total_tensors = total_bytes = distinct_bytes = 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(folder)
        writing = folder / placeholder
        fd, tmp_weights = create_temp(writing)
        plans = []
        with os.fdopen(fd, "wb") as fh:
            writer = _DedupingWriter(WeightsWriter(fh, layout))
            for src in paths:
                model, model_bytes = read_model(src)
                with SourceReader(model_bytes) as reader:
                    del model_bytes
                    plan = plan_weights(model, src, size_threshold_bytes)
                    plans.append(plan)
                    grand = sum(p.moving_bytes for p in plans)
                    for index, item in enumerate(plan.moving):
                        chunks = reader.chunks(index, item)
                        offset, new = writer.add(item.tensor, chunks, item.nbytes)
                        set_external(item.tensor, placeholder, offset, item.nbytes)
                        total_tensors += 1
                        total_bytes += item.nbytes
                        distinct_bytes += item.nbytes if new else 0
                        if progress is not None:
                            progress(total_bytes, grand)
                graphs.append(model)
            written = writer.writer.finish()
        name = f"family-{written.sha256[:16]}.weights"
        manifest = dataclasses.replace(written, file=name, tensors=len(writer.offsets))
        for src, model in zip(paths, graphs, strict=True):
            for tensor_ref in _moved(model, placeholder):
                _relocate(tensor_ref, name)
            write_manifest(model, manifest)
            writing = folder / src.name
            tmp_graphs.append(write_temp(writing, model.SerializeToString()))
        weights_path = folder / name
        writing = weights_path
        # Content-named: an existing file of this name that already holds these bytes (checked,
        # not assumed) may be mapped by a running pool: it is kept, not replaced. Only if it is
        # ours alone, though: a file another user planted (or can write, or has a second name
        # for) would let them change a live pool's weights later; it is replaced by a rename.
        if file_matches(weights_path, manifest.sha256, manifest.size_bytes) and _only_ours(
            weights_path
        ):
            tmp_weights.unlink()
        else:
            replace_output(tmp_weights, weights_path)
        tmp_weights = None
        # Weights first: until a graph lands, it refers to the weights file it referred to.
        for src, tmp in zip(paths, tmp_graphs, strict=True):
            writing = folder / src.name
            os.replace(tmp, folder / src.name)
        tmp_graphs = []
        fsync_dir(folder)
    except OSError as exc:
        if isinstance(exc, SharedMLError):
            raise
        raise output_error(writing, exc) from exc
    finally:
        for leftover in (tmp_weights, *tmp_graphs):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    leftover.unlink()
    removed = _remove_unreferenced(folder, keep=name)
    if removed:
        fsync_dir(folder)
    return FamilyResult(
        model_paths=tuple(folder / src.name for src in paths),
        weights_path=weights_path,
        tensors_total=total_tensors,
        tensors_distinct=len(writer.offsets),
        bytes_total=total_bytes,
        bytes_distinct=distinct_bytes,
        manifest=manifest,
        removed=removed,
    )


def _moved(model: ModelProto, location: str) -> list[Any]:
    return [
        ref.tensor
        for ref in iter_tensors(model.graph)
        if (info := ExternalData.of(ref.tensor)) is not None and info.location == location
    ]


def _relocate(tensor: Any, location: str) -> None:
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
