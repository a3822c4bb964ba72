"""The weights-file format: one module, two verbs (as safetensors' ``save_file``/``load_file``).

A weights file is tensors laid end to end by one rule (:meth:`WeightsManifest.alignment_for`):
a tensor of at least ``alignment_bytes`` (a page by default) starts at a multiple of it, so that
a mapping hands ORT page-aligned buffers; a smaller one starts at a multiple of 64 bytes, or of
the largest power of two not above its size when it is smaller still, which is still a multiple
of its element size. Every tensor's padding is thus smaller than the tensor, so a file stays
under twice its tensor data plus one page, whatever the model. The file ends on a page.

The graph that uses the file records it in its ``metadata_props`` under :data:`MANIFEST_KEY`
(:class:`WeightsManifest`: name, size, SHA-256, layout), and its tensors point into it as ONNX
external data.

Save: :class:`WeightsWriter` lays tensors out by the rule and hashes the file as it writes it
(never reading it back); :func:`write_manifest` records the result in the graph. Load:
:func:`read_manifest` reads and checks the record; :func:`file_matches` checks a file against
a recorded size and digest.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any, TypeGuard

from sharedml._errors import InvalidModelError, UnsafePathError
from sharedml._host._hashing import HashingWriter, sha256_file
from sharedml.model._proto import ModelProto, TensorProto

__all__ = [
    "DEFAULT_ALIGNMENT_BYTES",
    "END_ALIGNMENT_BYTES",
    "MANIFEST_KEY",
    "MAX_ALIGNMENT_BYTES",
    "SMALL_ALIGNMENT_BYTES",
    "ProgressCallback",
    "SharedWeights",
    "TensorDigest",
    "WeightsManifest",
    "WeightsWriter",
    "check_alignment",
    "digest_of",
    "file_matches",
    "read_manifest",
    "weights_path_for",
    "write_manifest",
]

DEFAULT_ALIGNMENT_BYTES = 4096  # bytes: one page, so every large tensor is mapped page-aligned
# bytes: the largest alignment prepare accepts. 1 GiB is the largest huge page (x86-64); beyond
# it no mapping gains anything, and a typo (a TiB) must be a clear error, not a huge file.
MAX_ALIGNMENT_BYTES = 1 << 30
# bytes: where tensors smaller than the alignment start. A cache line, and a multiple of every
# element size (complex128 is 16 bytes), which is what ORT's kernels and DLPack views need.
SMALL_ALIGNMENT_BYTES = 64
END_ALIGNMENT_BYTES = 4096  # bytes: the file ends on a page, as a mapping does
MANIFEST_KEY = "sharedml.weights"  # metadata_props key of the prepared model
# 2: tensors smaller than alignment_bytes start at SMALL_ALIGNMENT_BYTES (1: every tensor at
# alignment_bytes). Format 1 files still load: their offsets satisfy the format 2 rule.
# 3: tensors may also sit in other weights files of the folder (``shared``: hard links to the
# files of other cache entries holding the same tensors). Written only where ``shared`` is used.
_FORMAT_VERSION = 2
_SHARED_FORMAT_VERSION = 3
_READABLE_FORMATS = (1, 2, 3)

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` while a weights file is written."""


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _is_power_of_two(n: object) -> TypeGuard[int]:
    return isinstance(n, int) and n > 0 and not n & (n - 1)


def check_alignment(alignment_bytes: object) -> None:
    """Refuse an ``alignment_bytes`` the format does not allow (``ValueError``)."""
    if not (
        _is_power_of_two(alignment_bytes)
        and DEFAULT_ALIGNMENT_BYTES <= alignment_bytes <= MAX_ALIGNMENT_BYTES
    ):
        raise ValueError(
            f"alignment_bytes must be a power of two from {DEFAULT_ALIGNMENT_BYTES} to "
            f"{MAX_ALIGNMENT_BYTES} (1 GiB), not {alignment_bytes}."
        )


@dataclasses.dataclass(frozen=True, order=True)
class TensorDigest:
    """A tensor's content identity: equal digests are the same tensor, whatever its name.

    Attributes:
        data_type: ONNX ``TensorProto.DataType``.
        dims: Its shape.
        length: Its data in bytes.
        sha256: Hex SHA-256 of those bytes.
    """

    data_type: int
    dims: tuple[int, ...]
    length: int
    sha256: str

    def as_json(self) -> list[Any]:
        """The form a cache entry records (:meth:`from_json` reads it back)."""
        return [self.data_type, list(self.dims), self.length, self.sha256]

    @classmethod
    def from_json(cls, raw: Any) -> TensorDigest | None:
        """Read :meth:`as_json`'s form; ``None`` where it is malformed."""
        try:
            data_type, dims, length, sha = raw
            return cls(int(data_type), tuple(int(d) for d in dims), int(length), str(sha))
        except (TypeError, ValueError):
            return None


def digest_of(tensor: TensorProto, hashed: HashingWriter) -> TensorDigest:
    """The digest of ``tensor``, whose bytes (and only those) went through ``hashed``."""
    return TensorDigest(tensor.data_type, tuple(tensor.dims), hashed.position, hashed.hexdigest())


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
        """The alignment of a tensor of ``nbytes`` in this file: the format's layout rule.

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


def weights_path_for(model_path: str | os.PathLike[str]) -> Path:
    """The weights file that ``prepare`` writes beside ``model_path``."""
    path = Path(model_path)
    return path.with_name(path.stem + ".weights")


# --------------------------------------------------------------------------------------------
# Save


class WeightsWriter:
    """Writes one weights file by the layout rule, hashing it on the way: the save verb.

    ``layout`` gives the file's name and alignments; :meth:`add` appends a tensor at its
    alignment, :meth:`finish` ends the file on a page and returns ``layout`` with the file's
    size and SHA-256 filled in. Not thread-safe.
    """

    def __init__(self, fh: IO[bytes], layout: WeightsManifest) -> None:
        self._fh = fh
        self._out = HashingWriter(fh)
        self.layout = layout

    @property
    def position(self) -> int:
        """Bytes written so far."""
        return self._out.position

    def add(self, chunks: Iterable[bytes | memoryview], nbytes: int) -> int:
        """Append a tensor of ``nbytes`` given as ``chunks``; returns its offset.

        Raises:
            InvalidModelError: the chunks held another number of bytes than ``nbytes``.
        """
        self._out.pad_to(self.layout.alignment_for(nbytes))
        start = self._out.position
        self._out.write_all(chunks)
        if self._out.position - start != nbytes:  # pragma: no cover - the plan checked them
            raise InvalidModelError(
                f"A tensor for '{self.layout.file}' gave {self._out.position - start} bytes, "
                f"its plan said {nbytes}."
            )
        return start

    def mark(self) -> tuple[int, Any]:
        """Where the file is now, to go back to with :meth:`rollback`."""
        return self._out.mark()

    def rollback(self, mark: tuple[int, Any]) -> None:
        """Forget the tensors added since ``mark`` (the file is truncated back to it)."""
        self._out.rollback(mark)

    def finish(self, **changes: Any) -> WeightsManifest:
        """End the file on a page and make it durable; returns its manifest.

        Args:
            **changes: Other fields of the returned manifest (``tensors``, ``shared``).
        """
        self._out.pad_to(END_ALIGNMENT_BYTES)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        return dataclasses.replace(
            self.layout, size_bytes=self.position, sha256=self._out.hexdigest(), **changes
        )


def write_manifest(model: ModelProto, manifest: WeightsManifest) -> None:
    """Record ``manifest`` in ``model``'s metadata, replacing any earlier record."""
    keep = [p for p in model.metadata_props if p.key != MANIFEST_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    entry = model.metadata_props.add()
    entry.key, entry.value = MANIFEST_KEY, manifest.to_json()


# --------------------------------------------------------------------------------------------
# Load


def read_manifest(model: ModelProto) -> WeightsManifest | None:
    """The weights record of a prepared model, or ``None`` for a model prepare did not write.

    Raises:
        InvalidModelError: the record is malformed.
        UnsafePathError: it names a weights file outside the model's folder.
    """
    for prop in model.metadata_props:
        if prop.key == MANIFEST_KEY:
            return WeightsManifest.from_json(prop.value)
    return None


def file_matches(path: Path, sha256: str, size_bytes: int) -> bool:
    """Whether ``path`` is a file (not a symlink) of ``size_bytes`` whose SHA-256 is ``sha256``."""
    try:
        if path.is_symlink() or path.stat().st_size != size_bytes:
            return False
        return sha256_file(path) == sha256
    except OSError:
        return False
