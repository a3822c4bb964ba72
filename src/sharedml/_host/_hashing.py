"""Hashing bytes on their way to a file, and hashing a file: one writer computes every digest."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any

__all__ = [
    "HASH_CHUNK_BYTES",
    "HashingWriter",
    "sha256_file",
]

HASH_CHUNK_BYTES = 8 * 1024 * 1024  # bytes read at a time when hashing: bounds memory
_ZEROS = bytes(64 * 1024)  # padding is written from this, so no padding is ever allocated


class HashingWriter:
    """Bytes on their way to a file (or to nowhere), hashed and counted as they pass.

    The one hashing writer: prepare's weights files, a family's, the cache's rewrite of an
    entry's own file, and :func:`sha256_file` (which writes to nowhere) all go through it, so
    the digest a manifest records is computed by the same code that checks it.

    Attributes:
        position: Bytes written so far.
        sha: The running ``hashlib`` object over them.

    Not thread-safe: one writer, one thread.
    """

    def __init__(self, fh: IO[bytes] | None = None, sha: Any | None = None) -> None:
        """Write to ``fh`` (``None``: hash only), feeding ``sha`` (default: a fresh SHA-256)."""
        self._fh = fh
        self.position = 0
        self.sha = sha if sha is not None else hashlib.sha256()

    def hexdigest(self) -> str:
        """The hex digest of everything written so far."""
        return str(self.sha.hexdigest())

    def write(self, data: bytes | memoryview) -> None:
        """Write ``data`` and hash it."""
        if self._fh is not None:
            self._fh.write(data)
        self.sha.update(data)
        self.position += len(data)

    def write_all(self, chunks: Iterable[bytes | memoryview]) -> None:
        """Write each of ``chunks``."""
        for chunk in chunks:
            self.write(chunk)

    def through(self, chunks: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        """Each of ``chunks``, written (and hashed) before it is handed on."""
        for chunk in chunks:
            self.write(chunk)
            yield chunk

    def copy_from(self, source: IO[bytes]) -> None:
        """Write everything ``source`` has left, read in :data:`HASH_CHUNK_BYTES` chunks."""
        self.write_all(iter(lambda: source.read(HASH_CHUNK_BYTES), b""))

    def pad_to(self, alignment: int) -> None:
        """Write zeros up to the next multiple of ``alignment`` bytes."""
        pad = -self.position % alignment
        while pad:  # from a small buffer of zeros: padding costs no memory, whatever its size
            step = min(pad, len(_ZEROS))
            self.write(memoryview(_ZEROS)[:step])
            pad -= step

    def mark(self) -> tuple[int, Any]:
        """Where the writer is now, to go back to with :meth:`rollback`."""
        return self.position, self.sha.copy()

    def rollback(self, mark: tuple[int, Any]) -> None:
        """Forget everything written since ``mark``: the file is truncated back to it."""
        position, sha = mark
        if self._fh is not None:
            self._fh.seek(position)
            self._fh.truncate()
        self.position, self.sha = position, sha


def sha256_file(path: str | os.PathLike[str], sha: Any | None = None) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks.

    Args:
        path: The file.
        sha: A ``hashlib`` object to feed instead of a fresh one (its hex digest is returned).
    """
    hashing = HashingWriter(sha=sha)
    with open(path, "rb") as fh:
        hashing.copy_from(fh)
    return hashing.hexdigest()
