"""Whose fault a failed request is: one mapping from exceptions to HTTP and gRPC statuses."""

from __future__ import annotations

from collections.abc import Mapping

from sharedml._errors import InvalidInputError, PoolClosedError, PoolTimeout, RunError
from sharedml.protocol._tensors import RequestError

__all__ = ["GRPC_CODES", "status_of"]

# HTTP status -> gRPC status code name (grpc.StatusCode's), as the Open Inference Protocol's
# servers map them.
GRPC_CODES: Mapping[int, str] = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    406: "INVALID_ARGUMENT",
    408: "DEADLINE_EXCEEDED",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


def status_of(exc: BaseException) -> tuple[int, str, dict[str, str]] | None:
    """(HTTP status, message, headers) for an exception a request may end with; None: a bug.

    Bad input is the caller's (4xx); a model that fails otherwise is a 500; a pool that is
    closing, or that had no session in time, a 503.
    """
    if isinstance(exc, RequestError):
        return exc.status, exc.message, exc.headers
    if isinstance(exc, InvalidInputError):
        return 400, str(exc), {}
    if isinstance(exc, (PoolClosedError, PoolTimeout)):
        return 503, str(exc), {}
    if isinstance(exc, RunError):
        return 500, str(exc), {}
    return None
