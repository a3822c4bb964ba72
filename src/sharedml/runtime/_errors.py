"""ONNX Runtime's run failures as sharedml's errors: the one place that reads ORT's type names.

ORT's Python binding raises exceptions named after its status codes (``InvalidArgument``,
``Fail``, ``EPFail``, ...), none of them a subclass of anything but ``Exception``. The pool's
session source runs every ``Run`` inside :func:`mapped_run_errors` (as httpx's transports map
their libraries' exceptions with ``map_exceptions``), so what reaches the scheduler and the
callers is a :class:`~sharedml.RunError` that keeps ORT's message, type name and exception:
:class:`~sharedml.InvalidInputError` for a feed that does not fit, and ``session_lost`` set
where ORT no longer promises a usable session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sharedml._errors import InvalidInputError, RunError, SharedMLError

__all__ = ["is_session_lost", "mapped_run_errors", "run_error"]

# Device and engine faults: after these ORT does not promise that the session still works.
_SESSION_LOST = frozenset(("EPFail", "EngineError"))
# A feed that does not fit: InvalidArgument (shapes, dtypes) from ORT's C++ layer, ValueError
# from its Python layer (a missing input).
_INVALID_INPUT = frozenset(("InvalidArgument", "ValueError"))


def is_session_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (ORT's own, or mapped) leaves its session unusable."""
    if isinstance(exc, RunError):
        return exc.session_lost
    return type(exc).__name__ in _SESSION_LOST


def run_error(exc: BaseException) -> SharedMLError:
    """``exc`` as a sharedml error that keeps ORT's message and type name (sharedml's own as is)."""
    if isinstance(exc, SharedMLError):
        return exc
    kind = type(exc).__name__
    message = " ".join(str(exc).split()) or kind
    cls = InvalidInputError if kind in _INVALID_INPUT else RunError
    error = cls(
        f"onnxruntime raised {kind}: {message}", ort_type=kind, session_lost=kind in _SESSION_LOST
    )
    error.__cause__ = exc
    return error


@contextlib.contextmanager
def mapped_run_errors() -> Iterator[None]:
    """Raise what a ``Run`` inside raises as :func:`run_error` gives it."""
    try:
        yield
    except SharedMLError:
        raise
    except Exception as exc:
        raise run_error(exc) from exc
