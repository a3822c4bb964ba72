"""Reading a model's source bytes for prepare: every byte once, hashed as it is handed out.

The data is streamed: external tensors are read in chunks, so peak memory is about one chunk
plus the graph, not the model's size. Every byte is read from a file opened without following
symlinks below the model's folder (:meth:`sharedml.model._graph.ExternalSlice.open`), and the
digest of what was handed out (``PrepareResult.source_sha256``) is what the cache keys an entry
by, so an entry holds exactly what its key says.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from sharedml._errors import ExternalDataError
from sharedml._host._hashing import HashingWriter
from sharedml.model._graph import ExternalSlice, inline_bytes
from sharedml.prepared._files import COPY_CHUNK_BYTES
from sharedml.prepared._plan import TensorSource

__all__ = ["SourceReader", "hash_sources", "reads"]


class SourceReader:
    """Hands out the source bytes prepare copies, each read once, and hashes exactly those.

    The digest covers the model file's bytes, then, in plan order, each external slice read
    (framed by its index in the plan, its location, offset and length) and each tied tensor's
    reuse of an earlier slice. prepare's output is a function of exactly this sequence, so an
    entry keyed by the digest holds what its key says even when a source file changes between
    a key lookup and the copy, or during the copy: the changed bytes get their own key.

    One external file is open at a time: models with a file per tensor have thousands.
    """

    def __init__(self, model_bytes: bytes) -> None:
        self._hashed = HashingWriter()  # to nowhere: only the digest is kept
        self._hashed.write(f"sharedml-source:1:{len(model_bytes)}\n".encode())
        self._hashed.write(model_bytes)
        self._open: tuple[Path, BinaryIO] | None = None

    def __enter__(self) -> SourceReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def hexdigest(self) -> str:
        """The digest of everything handed out so far."""
        return self._hashed.hexdigest()

    def tied(self, index: int, earlier: int) -> None:
        """Record that tensor ``index`` of the plan reuses the bytes of tensor ``earlier``."""
        self._hashed.write(f"\n{index} = {earlier}\n".encode())

    def read(self, index: int, piece: ExternalSlice, name: str) -> Iterator[bytes]:
        """The bytes of tensor ``index`` (``name``), in chunks, from a checked open file."""
        fh = self._file(piece, name)
        self._hashed.write(f"\n{index} {piece.location!r} {piece.offset} {piece.length}\n".encode())
        fh.seek(piece.offset)
        remaining = piece.length
        while remaining:
            try:
                chunk = fh.read(min(COPY_CHUNK_BYTES, remaining))
            except OSError as exc:
                raise ExternalDataError(
                    f"Reading tensor '{name}' from external data file '{piece.file}' failed "
                    f"({exc.strerror or exc})."
                ) from None
            if not chunk:
                raise ExternalDataError(
                    f"External data file '{piece.file}' ended early while reading tensor '{name}'."
                )
            self._hashed.write(chunk)
            remaining -= len(chunk)
            yield chunk

    def chunks(self, index: int, src: TensorSource) -> Iterator[bytes]:
        """The bytes of tensor ``index`` of the plan: from the graph, or read as :meth:`read`."""
        if src.piece is None:
            yield inline_bytes(src.tensor)
        else:
            yield from self.read(index, src.piece, src.tensor.name)

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


def reads(moving: list[TensorSource]) -> Iterator[tuple[int, TensorSource, int | None]]:
    """Each tensor that moves, with the index of an earlier one whose bytes it shares (tied)."""
    first: dict[tuple[Path, int, int], int] = {}
    for index, src in enumerate(moving):
        if src.piece is None:
            yield index, src, None
            continue
        earlier = first.setdefault((src.piece.file, src.piece.offset, src.nbytes), index)
        yield index, src, earlier if earlier != index else None


def hash_sources(moving: list[TensorSource], reader: SourceReader) -> None:
    """Feed ``reader`` what prepare would read from ``moving``, without writing anything."""
    for index, src, earlier in reads(moving):
        if earlier is not None:
            reader.tied(index, earlier)
        elif src.piece is not None:
            for _chunk in reader.read(index, src.piece, src.tensor.name):
                pass
