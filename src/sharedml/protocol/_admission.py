"""Admission: what a server lets a request hold, reserved before the request's bytes are read.

One budget per server process (:class:`InflightBytes`) holds the bytes of every request in
flight: its body from the moment it is admitted, then its decoded arrays and a JSON body's parse
while they last. A request is admitted, or refused, **before its body is read**:

- A body with a ``Content-Length`` reserves that length at once: a length over the request limit
  is a 413, one the requests in flight leave no room for a 429 with ``Retry-After``; nothing of
  it has been read either way.
- A chunked body (no length) grows its reservation with each chunk it delivers, and is refused
  (413, or 429) as soon as it would pass the limit or the budget: a chunk header declaring a
  terabyte costs what has really arrived, never more than the limit.
- Every wait for the next piece of a body is bounded (:attr:`HttpLimits.body_timeout_s`): a
  body that stops arriving (a chunk header declaring more than is ever sent, a client that
  stalls) gets a 408 rather than holding its reservation for good.

Without this, eight 200 MiB bodies read whole before they were judged took a replica to 3.3 GiB
against a 1 GiB budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
from collections.abc import AsyncIterator

from sharedml.protocol._tensors import MIB, RequestError, size_text

__all__ = [
    "JSON_PARSE_EXPANSION",
    "HttpLimits",
    "InflightBytes",
    "Reservation",
    "read_body",
]

# Bytes of Python objects json.loads and np.asarray may build per byte of a JSON body: 34
# measured for "[0],[0],..." (a list per 4 bytes), 10 for "0.5,0.5,...", 2.6 for float32 values
# as clients print them.
JSON_PARSE_EXPANSION = 40


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What a server accepts from requests, so that no request, or handful of them, exhausts it.

    The same limits apply to every wire format (HTTP JSON, the binary tensor extension,
    ``.npy``/``.npz``, gRPC).

    Attributes:
        max_request_bytes: The most bytes one request's input arrays may take once decoded
            (as their headers or shapes declare them, counting a zero dimension as one); also
            the largest binary body and the largest gRPC message. Beyond it: 413
            (gRPC ``RESOURCE_EXHAUSTED``).
        max_inflight_bytes: The most bytes the requests a server process holds may take
            together: each request's body from its admission, its decoded arrays, and a JSON
            body's parse (:data:`JSON_PARSE_EXPANSION` times its size) while it lasts, until its
            reply is written. A request beyond it gets 429 with ``Retry-After`` (gRPC
            ``RESOURCE_EXHAUSTED``); one that alone is larger, 413.
        max_json_bytes: The largest JSON body or JSON header of the binary tensor extension.
            Beyond it: 413 (send binary tensors).
        max_rows: The most rows (axis 0) an input array may have. Beyond it: 413.
        body_timeout_s: The longest wait for the next piece of a request body. Beyond it: 408.
    """

    max_request_bytes: int = 256 * MIB
    max_inflight_bytes: int = 1024 * MIB
    max_json_bytes: int = 8 * MIB
    max_rows: int = 65_536
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "body_timeout_s":
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or value <= 0
                ):
                    raise ValueError(
                        f"HttpLimits.body_timeout_s must be a positive number of seconds, not "
                        f"{value!r}."
                    )
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"HttpLimits.{field.name} must be a positive integer, not {value!r}."
                )


class Reservation:
    """Bytes a request holds of its server's :class:`InflightBytes`, until :meth:`release`."""

    def __init__(self, budget: InflightBytes | None, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def resize(self, nbytes: int, what: str = "The request") -> None:
        """Hold ``nbytes`` instead (a body that grew, a JSON body's arrays once parsed).

        Raises:
            RequestError: 429 (or 413) where growing does not fit the budget; the reservation
                is then unchanged.
        """
        if self._budget is not None:
            self._budget._resize(self, nbytes, what)
        else:
            self.nbytes = nbytes

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        self.resize(0)


class InflightBytes:
    """A server's budget of bytes for the requests it holds at once. Thread-safe.

    Args:
        limit_bytes: :attr:`HttpLimits.max_inflight_bytes`.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Bytes reserved now."""
        return self._used

    def reserve(self, nbytes: int, what: str = "The request") -> Reservation:
        """Reserve ``nbytes`` for one request.

        Raises:
            RequestError: 413 where ``nbytes`` exceeds the whole budget, 429 where the requests
                in flight leave too little of it.
        """
        reservation = Reservation(self, 0)
        self._resize(reservation, nbytes, what)
        return reservation

    def _resize(self, reservation: Reservation, nbytes: int, what: str) -> None:
        if nbytes > self.limit_bytes:
            raise RequestError(
                413,
                f"{what} needs {size_text(nbytes)} while it is held, more than this server's "
                f"{size_text(self.limit_bytes)} for all requests in flight: send smaller "
                "requests (binary tensors rather than JSON for large ones).",
            )
        with self._lock:
            grow = nbytes - reservation.nbytes
            if grow > 0 and self._used + grow > self.limit_bytes:
                raise RequestError(
                    429,
                    f"{what} needs {size_text(nbytes)} while it is held, and the requests this "
                    f"server holds already take {size_text(self._used)} of its "
                    f"{size_text(self.limit_bytes)}: retry shortly, or send smaller requests.",
                    {"Retry-After": "1"},
                )
            self._used += grow
            reservation.nbytes = nbytes


def _too_long(size: int, max_bytes: int, declared: bool) -> RequestError:
    says = "declares" if declared else "has sent"
    return RequestError(
        413,
        f"The body {says} {size} bytes, and this server takes at most {max_bytes} in one "
        "request: send smaller requests (HttpLimits.max_request_bytes, max_json_bytes).",
    )


async def read_body(
    chunks: AsyncIterator[bytes],
    *,
    declared: int | None,
    max_bytes: int,
    budget: InflightBytes | None,
    timeout_s: float,
) -> tuple[bytearray, Reservation]:
    """Read a request body that was admitted first: reserved before, refused as it grows.

    Args:
        chunks: The body's pieces as the server delivers them (``request.stream()``).
        declared: Its ``Content-Length``, or None for a chunked body.
        max_bytes: The longest body this request may send.
        budget: The server's budget (None: no budget, as in tests of a codec alone).
        timeout_s: The longest wait for the next piece.

    Returns:
        The body (a ``Content-Length`` body in one allocation of exactly that size) and its
        reservation, which holds the body's bytes: resize it as the request decodes, release
        it once the reply is written.

    Raises:
        RequestError: 413 for a body over ``max_bytes`` (before any of it is read where its
            length is declared), 429 where the budget has no room (likewise), 408 where the
            body stops arriving for ``timeout_s``, 400 for a body shorter or longer than
            its ``Content-Length``.
    """
    if declared is not None and declared > max_bytes:
        raise _too_long(declared, max_bytes, declared=True)
    reservation = (
        budget.reserve(declared or 0, "The body") if budget else Reservation(None, declared or 0)
    )
    try:
        body = bytearray(declared) if declared else bytearray()
        size = 0
        iterator = chunks.__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(iterator.__anext__(), timeout_s)
            except StopAsyncIteration:
                break
            except (asyncio.TimeoutError, TimeoutError):
                raise RequestError(
                    408,
                    f"The body stopped arriving: nothing came for {timeout_s:g} s after "
                    f"{size} bytes. Send the whole body at once (HttpLimits.body_timeout_s).",
                ) from None
            if not chunk:
                continue
            end = size + len(chunk)
            if declared is not None:
                if end > declared:
                    raise RequestError(
                        400, f"The body is longer than its Content-Length ({declared} bytes)."
                    )
                body[size:end] = chunk
            else:
                if end > max_bytes:
                    raise _too_long(end, max_bytes, declared=False)
                reservation.resize(end, "The body")
                body += chunk
            size = end
        if declared is not None and size != declared:
            raise RequestError(
                400,
                f"The body ended after {size} of the {declared} bytes its Content-Length declares.",
            )
    except BaseException:
        reservation.release()
        raise
    return body, reservation
