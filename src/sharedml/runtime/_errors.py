"""ONNX Runtime's failures as sharedml's errors: the one place that reads ORT's type names.

ORT's Python binding raises exceptions named after its status codes (``InvalidArgument``,
``Fail``, ``EPFail``, ...), none of them a subclass of anything but ``Exception``. The pool's
session source runs every ``Run`` inside :func:`mapped_run_errors` (as httpx's transports map
their libraries' exceptions with ``map_exceptions``), so what reaches the scheduler and the
callers is a :class:`~sharedml.RunError` that keeps ORT's message, type name and exception:
:class:`~sharedml.InvalidInputError` for a feed that does not fit, and ``session_lost`` set
where ORT no longer promises a usable session. A session that ORT cannot create because it
refuses the model itself (:func:`is_model_refused`) becomes an
:class:`~sharedml.UnsupportedModelError`: no other route of sharedml's would load it either.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from sharedml._errors import InvalidInputError, RunError, SharedMLError, UnsupportedModelError

__all__ = [
    "is_model_refused",
    "is_session_lost",
    "mapped_run_errors",
    "refused_model_error",
    "run_error",
]

# Device and engine faults: after these ORT does not promise that the session still works.
_SESSION_LOST = frozenset(("EPFail", "EngineError"))
# A feed that does not fit: InvalidArgument (shapes, dtypes) from ORT's C++ layer, ValueError
# from its Python layer (a missing input).
_INVALID_INPUT = frozenset(("InvalidArgument", "ValueError"))


# ORT's refusals of a model itself, which a plain session over the same file meets too: a graph
# it finds invalid (an unknown operator), a file it cannot parse, an operator without a kernel
# for the providers. ORT's model loader raises Fail for the rest, always with this prefix: an IR
# version or opset newer than it reads, a domain it does not know, mismatched types.
_MODEL_REFUSED = frozenset(("InvalidGraph", "InvalidProtobuf", "NotImplemented"))
_LOADER_PREFIX = "Load model from"
_IR_VERSION = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")


def is_model_refused(exc: BaseException | str) -> bool:
    """Whether ORT raised ``exc`` because it refuses the model itself, for every session.

    ``exc`` may also be a child process's error line, ``"TypeName: message"``.
    """
    if isinstance(exc, str):
        kind, _, message = exc.partition(":")
    else:
        kind, message = type(exc).__name__, str(exc)
    return kind in _MODEL_REFUSED or (kind == "Fail" and _LOADER_PREFIX in message)


def refused_model_error(exc: BaseException, model: str) -> UnsupportedModelError:
    """``exc`` (see :func:`is_model_refused`) as the error a caller sees, with what to do."""
    import onnxruntime as ort

    message = " ".join(str(exc).split())
    advice = ""
    if found := _IR_VERSION.search(message):
        advice = (
            f" The model's IR version {found[1]} is newer than onnxruntime {ort.__version__} "
            f"reads (at most {found[2]}): onnx writes its newest IR version by default; save "
            f"the model with ir_version={found[2]} where its opsets allow, or use a newer "
            "onnxruntime."
        )
    error = UnsupportedModelError(
        f"onnxruntime {ort.__version__} refuses the model '{model}', as a plain session would: "
        f"{message}.{advice}"
    )
    error.__cause__ = exc
    return error


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
