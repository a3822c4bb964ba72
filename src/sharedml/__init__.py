"""sharedml: many ONNX Runtime sessions, one copy of the weights.

The pipeline, one subpackage a stage (imports only go down it)::

    model/        ONNX models as sharedml reads them: one walk over the tensors, input specs
    runtime/      the installed onnxruntime: capabilities, providers, session options
    cache/        the content-keyed cache of prepared models (public: sharedml.cache)
    prepared/     prepare: every weight into one aligned, verified file (sharedml.prepared)
    weights/      mapped once per process, once per GPU; lent to sessions (sharedml.weights)
    route/        how a pool's sessions borrow them (sharedml.route)
    pool/         SessionPool: the queue, batching, lifecycle; run() from any thread
    inspection/   sharedml inspect: N plain vs N pooled sessions, measured in children
    cli/, ray/    the sharedml command; Ray Serve replicas sharing weights per node

The names here are what an application needs (``__init__.pyi`` lists them); integrators and
strategy authors import the public modules: ``sharedml.weights``, ``sharedml.route``,
``sharedml.runtime``, ``sharedml.prepared``, ``sharedml.cache``, ``sharedml.measure`` and
``sharedml.ray``.
"""

from __future__ import annotations

import importlib.metadata as _metadata
from typing import Any as _Any

from sharedml import _exports

try:
    __version__ = _metadata.version("sharedml")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"


def _not_here(name: str) -> _Any:
    """A name the top level does not export: the error names its public module, if it has one."""
    homes = [m for m in _exports.public_modules(__name__) if name in _exports.exported(m)]
    where = f": import it from {homes[0]} ({homes[0]}.{name})" if homes else ""
    raise AttributeError(f"module 'sharedml' has no attribute {name!r}{where}")


__all__, __getattr__, __dir__ = _exports.attach(__name__, fallback=_not_here)
__all__ = ["__version__", *__all__]

# The errors are cheap to import and raised from deep inside: they name their public home from
# the start, so that a traceback says ``sharedml.PoolClosedError`` before anyone looked it up.
for _name in __all__:
    if _name.endswith(("Error", "Timeout")):
        __getattr__(_name)
del _name
