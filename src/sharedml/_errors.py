"""The exceptions sharedml raises.

Every error is a ``SharedMLError``; where a built-in exception means the same thing, the
subclass inherits it too, so callers can catch either::

    SharedMLError
    ├── ModelError (ValueError)              the model file cannot be used
    │   ├── ModelNotFoundError (FileNotFoundError)
    │   ├── InvalidModelError                not an ONNX model, or a malformed one
    │   ├── UnsupportedModelError            one onnxruntime refuses (a SessionCreationError too)
    │   └── ExternalDataError                external data that is missing, short or unsafe
    │       └── UnsafePathError (PermissionError)   a location escaping the model's folder
    ├── WeightsMismatchError                 a prepared weights file changed after prepare
    ├── PrepareError                         prepare refused (e.g. it would overwrite its source)
    │   ├── OutputError (OSError)            its outputs cannot be written (full disk, no access)
    │   ├── FamilyError (ValueError)         a family's members clash or sit in the output folder
    │   └── CompressError (ValueError)       compressed weights asked for where none can be made
    ├── CacheError                           a cache folder or entry that cannot be trusted or used
    ├── ProviderError                        an execution provider that cannot be used here
    ├── SessionCreationError                 ONNX Runtime refused to create a session
    ├── RunError (RuntimeError)              ONNX Runtime failed a pool's run (its type name kept)
    │   └── InvalidInputError (ValueError)   a feed that does not fit the model's inputs
    ├── NotBatchableError (ValueError)       batching asked for a model whose rows cannot merge
    ├── PoolError
    │   ├── PoolClosedError (RuntimeError)   work given to a closed pool
    │   └── PoolTimeout (TimeoutError)       no session became free in time
    └── MeasurementError                     a memory measurement subprocess failed
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "CompressError",
    "ExternalDataError",
    "FamilyError",
    "InvalidInputError",
    "InvalidModelError",
    "MeasurementError",
    "NotBatchableError",
    "ModelError",
    "ModelNotFoundError",
    "OutputError",
    "PoolClosedError",
    "PoolError",
    "PoolTimeout",
    "PrepareError",
    "ProviderError",
    "RunError",
    "SessionCreationError",
    "SharedMLError",
    "UnsafePathError",
    "UnsupportedModelError",
    "WeightsMismatchError",
    "missing_package",
]


class SharedMLError(Exception):
    """Base class of every error sharedml raises."""


class ModelError(SharedMLError, ValueError):
    """The model file, or data it refers to, cannot be used."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model file does not exist."""


class InvalidModelError(ModelError):
    """The file is not a valid ONNX model."""


class ExternalDataError(ModelError):
    """A tensor's external data is missing, truncated, overlapping or otherwise unusable."""


class UnsafePathError(ExternalDataError, PermissionError):
    """An external data location resolves outside the model's folder."""


class WeightsMismatchError(SharedMLError):
    """A prepared model's weights file no longer matches what prepare recorded."""


class PrepareError(SharedMLError):
    """``prepare`` refused to run (for example, it would overwrite its own source)."""


class OutputError(PrepareError, OSError):
    """``prepare`` could not write its outputs: a full disk, a folder it may not write, ...

    The message names the path and the fix; ``errno`` is the operating system's error number
    (``errno.ENOSPC`` for a full disk), so code that handles ``OSError`` keeps working.
    """


class FamilyError(PrepareError, ValueError):
    """``prepare_family([a, b, ...], folder)`` refused its members, before writing anything.

    Two members with one file name (both would be written to the same path), or a member (or
    one of its external data files) inside the output folder, which prepare would overwrite.
    """


class CompressError(PrepareError, ValueError):
    """Compressed weights were asked for where none can be made.

    The model holds no MatMul or Gemm weight to compress, or the installed onnxruntime cannot
    write or run the asked-for format (8-bit blocks need onnxruntime 1.22 or later).
    """


class CacheError(SharedMLError):
    """A cache folder or entry cannot be trusted (another user could write it) or used."""


class ProviderError(SharedMLError, ValueError):
    """An execution provider was asked for that this onnxruntime build cannot use."""


class SessionCreationError(SharedMLError):
    """ONNX Runtime failed to create a session for the model."""


class UnsupportedModelError(ModelError, SessionCreationError):
    """This onnxruntime refuses the model itself, as a plain ``InferenceSession`` would.

    An IR version or opset newer than it reads, an operator it has no kernel or schema for, a
    graph it finds invalid (types that do not match). The message is ORT's, with the model's
    path; no route of sharedml's can load what ORT cannot, so none is tried instead.
    """


class RunError(SharedMLError, RuntimeError):
    """ONNX Runtime raised while a pool ran a request.

    The message is ORT's, after the name of ORT's exception type; the original exception is the
    ``__cause__``, and its type name is :attr:`ort_type` (``"InvalidArgument"``, ``"Fail"``...).
    :attr:`session_lost`: ORT no longer promises a usable session (a device or engine fault);
    a pool replaces it.
    """

    def __init__(self, message: str, *, ort_type: str = "", session_lost: bool = False) -> None:
        super().__init__(message)
        self.ort_type = ort_type
        self.session_lost = session_lost


class InvalidInputError(RunError, ValueError):
    """A feed does not fit the model's inputs (a missing or unknown name, dtype, rank, shape)."""


class NotBatchableError(SharedMLError, ValueError):
    """Batching was asked for a model whose requests cannot be merged along axis 0."""


class PoolError(SharedMLError):
    """Base class for errors of a :class:`~sharedml.SessionPool`."""


class PoolClosedError(PoolError, RuntimeError):
    """Work was given to a pool that is closing or closed."""


class PoolTimeout(PoolError, TimeoutError):
    """No session of the pool became free within the timeout."""


class MeasurementError(SharedMLError):
    """A memory or timing measurement in a subprocess failed.

    Attributes:
        report: Where ``sharedml.inspect`` failed after its static part, the partial
            ``InspectReport`` (weights, inputs, the trial run's error); else None.
    """

    report: object = None


def missing_package(feature: str, package: str, extra: str) -> SharedMLError:
    """The error for a feature whose optional package is not installed, saying how to get it.

    sharedml is installed from a checkout or a wheel, not from a package index, so
    ``pip install 'sharedml[extra]'`` would not find it: the message gives the package itself,
    and the extra for each way of installing sharedml.
    """
    return SharedMLError(
        f"{feature} needs {package}, which is not installed: pip install {package} (or, in a "
        f"checkout of sharedml, pip install '.[{extra}]'; with a wheel, pip install "
        f"'sharedml-<version>-py3-none-any.whl[{extra}]')."
    )
