"""``.npy`` and ``.npz`` bodies to feeds, outputs to ``.npy``/``.npz`` replies.

Decisions:

- A body is judged before it is decoded. The ``.npy`` header of a body, or of each ``.npz``
  member (read through the first few KiB of the member, whatever the archive says it unpacks
  to), says what the arrays will be: their names, dtypes, ranks and fixed dimensions are
  checked against the model's inputs (400), their rows and bytes against the limits (413), and
  their bytes are reserved from the server's budget (429 when the requests it holds already
  take it) before a byte of array data is inflated. An archive member is then read for exactly
  the bytes its header declares: one that holds more, or whose zip entry declares another size,
  is refused, so a compression bomb inflates a few KiB at most.
- Bodies are read with ``allow_pickle=False``, replies written the same way (string outputs as
  unicode arrays): a body can never run code, and clients need no pickle.
"""

from __future__ import annotations

import dataclasses
import io
import math
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from typing import IO, Any

import numpy as np

from sharedml.protocol._admission import Reservation
from sharedml.protocol._tensors import (
    RequestError,
    TensorInfo,
    bad,
    check_names,
    check_request_bytes,
    check_tensor,
)

__all__ = [
    "NPY",
    "NPZ",
    "NPY_MAGIC",
    "ZIP_MAGICS",
    "npy_reply",
    "npz_reply",
    "parse_npy",
    "parse_npz",
]

NPY = "application/x-npy"
NPZ = "application/x-npz"
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_MAX_NPY_HEADER_BYTES = 10_000  # numpy's own default for a header it reads without pickle
# What np.savez and np.savez_compressed write. Others are refused: LZMA's header chooses the
# dictionary its decoder allocates (up to 4 GiB) before a byte is inflated.
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)


class _BufferReader(io.RawIOBase):
    """A seekable reader over a buffer, without the copy ``io.BytesIO(bytearray)`` makes."""

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(buffer).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _npy_header(fp: IO[bytes], what: str) -> tuple[np.dtype[Any], tuple[int, ...], bool]:
    """The dtype, shape and order an ``.npy`` stream's header declares (reads only the header).

    Raises:
        RequestError: 400 for a header numpy cannot read, one of an object array (it would need
            pickle), or a version other than 1.0 and 2.0.
    """
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(
                fp, max_header_size=_MAX_NPY_HEADER_BYTES
            )
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(
                fp, max_header_size=_MAX_NPY_HEADER_BYTES
            )
        else:
            raise bad(
                f"{what} is not a readable .npy array (format version {version}; np.save "
                "writes 1.0 or 2.0)."
            )
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise bad(f"{what} is not a readable .npy array ({exc}).") from None
    if dtype.hasobject:
        raise bad(
            f"{what} holds Python objects, which would need pickle: send numbers, or strings "
            "as a unicode array."
        )
    if dtype.itemsize == 0:
        raise bad(f"{what} has dtype {dtype.str}, whose items take no bytes.")
    return dtype, tuple(shape), bool(fortran)


def parse_npy(
    body: bytearray | bytes,
    inputs: Mapping[str, TensorInfo],
    *,
    max_rows: int,
    max_bytes: int,
    reservation: Reservation,
) -> dict[str, np.ndarray]:
    """An ``.npy`` body (a one-input model): its feed, the array being the body's own bytes."""
    if len(inputs) != 1:
        raise bad(
            f"An .npy body carries one array, but the model has {len(inputs)} inputs "
            f"({', '.join(inputs)}): send an .npz with one array per input name."
        )
    name = next(iter(inputs))
    fp = _BufferReader(body)
    dtype, shape, fortran = _npy_header(fp, "The .npy body")  # type: ignore[arg-type]
    offset = fp.tell()
    nbytes = check_tensor(name, dtype, shape, inputs, max_rows)
    check_request_bytes(nbytes, max_bytes, "The .npy body's header declares")
    count = math.prod(shape)
    if len(body) - offset != count * dtype.itemsize:
        raise bad(
            f"The .npy body holds {len(body) - offset} bytes of data, but its header declares "
            f"shape {shape} of {dtype.str}, {count * dtype.itemsize} bytes: send the whole "
            "array as np.save writes it."
        )
    reservation.resize(len(body), "The .npy body")
    # The array is the body's own bytes: nothing is copied.
    flat = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    array = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return {name: array}


@dataclasses.dataclass(frozen=True)
class _Member:
    info: zipfile.ZipInfo
    name: str
    nbytes: int  # of its array, as its header declares
    bound: int  # the same, a zero dimension counted as one (what the limits judge)


def _open_member(archive: zipfile.ZipFile, member: zipfile.ZipInfo, what: str) -> IO[bytes]:
    try:
        return archive.open(member)
    except (RuntimeError, NotImplementedError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise bad(f"{what} cannot be read ({exc}).") from None


def _npz_members(
    archive: zipfile.ZipFile, inputs: Mapping[str, TensorInfo], max_rows: int
) -> Iterator[_Member]:
    """Each member's header, checked: reads a few KiB of each, whatever it claims to hold."""
    members = archive.infolist()
    if not members:
        raise bad("The .npz archive holds no arrays: save one per input name (np.savez).")
    if len(members) > len(inputs):
        raise bad(
            f"The .npz archive holds {len(members)} members, but the model has "
            f"{len(inputs)} input(s) ({', '.join(inputs)}): one array per input name."
        )
    names: list[str] = []
    for member in members:
        if not member.filename.endswith(".npy"):
            raise bad(
                f"The .npz archive holds {member.filename[:80]!r}, which is not an .npy array: "
                "save one array per input name (np.savez)."
            )
        name = member.filename[: -len(".npy")]
        what = f"Member '{member.filename[:80]}' of the .npz archive"
        if name in names:
            raise bad(f"{what} is there twice.")
        names.append(name)
        check_names([name], inputs, "The .npz archive")
        if member.compress_type not in _ZIP_METHODS:
            raise bad(
                f"{what} is compressed with method {member.compress_type}: use np.savez or "
                "np.savez_compressed (stored or deflated members)."
            )
        with _open_member(archive, member, what) as fp:
            dtype, shape, _ = _npy_header(fp, what)
            header_bytes = fp.tell()
        bound = check_tensor(name, dtype, shape, inputs, max_rows)
        nbytes = math.prod(shape) * dtype.itemsize
        if member.file_size != header_bytes + nbytes:
            raise bad(
                f"{what} declares {member.file_size} bytes unpacked, but its .npy header "
                f"describes {header_bytes + nbytes} (shape {shape} of {dtype.str}): the archive "
                "is damaged or forged."
            )
        yield _Member(member, name, nbytes, bound)


def _read_member(archive: zipfile.ZipFile, member: _Member) -> np.ndarray:
    """The member's array, inflating no more than its header declares (plus one read)."""
    what = f"Member '{member.info.filename}' of the .npz archive"
    with _open_member(archive, member.info, what) as fp:
        try:
            array = np.lib.format.read_array(
                fp, allow_pickle=False, max_header_size=_MAX_NPY_HEADER_BYTES
            )
            extra = fp.read(1)  # at EOF, zipfile also checks the member's CRC
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise bad(f"{what} is not a readable .npy array ({exc}).") from None
    if extra:
        raise bad(f"{what} holds more data than its .npy header declares: it is forged.")
    return np.asarray(array)


def parse_npz(
    body: bytearray | bytes,
    inputs: Mapping[str, TensorInfo],
    *,
    max_rows: int,
    max_bytes: int,
    reservation: Reservation,
) -> dict[str, np.ndarray]:
    """An ``.npz`` body: its feed, each member judged from its header before it is inflated."""
    try:
        archive = zipfile.ZipFile(_BufferReader(body))
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise bad(f"The body is not a readable .npz archive ({exc}).") from None
    with archive:
        members = list(_npz_members(archive, inputs, max_rows))
        check_request_bytes(sum(m.bound for m in members), max_bytes, "The .npz headers declare")
        reservation.resize(len(body) + sum(m.nbytes for m in members), "The .npz body")
        return {m.name: _read_member(archive, m) for m in members}


def _storable(array: np.ndarray) -> np.ndarray:
    """``array`` as ``.npy`` stores it without pickle: ORT's string outputs as unicode."""
    array = np.asarray(array)
    return array.astype(np.str_) if array.dtype.hasobject else array


def npy_reply(outputs: Mapping[str, np.ndarray]) -> bytes:
    """One output as an ``.npy`` body.

    Raises:
        RequestError: 406 where there are several outputs.
    """
    if len(outputs) != 1:
        raise RequestError(
            406,
            f"An .npy reply holds one array, but {len(outputs)} outputs were asked for "
            f"({', '.join(outputs)}): pick one with ?output=<name>, or accept {NPZ}.",
        )
    buf = io.BytesIO()
    np.save(buf, _storable(next(iter(outputs.values()))), allow_pickle=False)
    return buf.getvalue()


def npz_reply(outputs: Mapping[str, np.ndarray]) -> bytes:
    """An ``.npz`` archive of ``outputs``, as np.savez writes it (any output name, ``file`` too).

    np.savez takes the arrays as keyword arguments, so an output named ``file`` (its first
    parameter) cannot go through it; the archive is one stored ``<name>.npy`` per output.
    """
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in outputs.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, _storable(array), allow_pickle=False)
    return buf.getvalue()
