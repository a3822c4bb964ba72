"""sharedml: many ONNX Runtime sessions, one copy of the weights.

The pipeline, one private module a stage::

    model.onnx        _onnx      one walk over a model's tensors; external data parsed once
      -> prepared     _prepare   every weight into one aligned, verified file (cached: _cache)
      -> weights      _weights   mapped once per process (_device: once per GPU)
      -> route        _route     how sessions borrow them (_prepack: ORT's packed weights too)
      -> sessions     _options, _providers   what each session is created with
      -> pool         _pool      the queue and the lifecycle; run() from any thread
    inspect           _inspect   measures N plain vs N pooled sessions (_measure, in children)

Platform facts live in ``_host``; errors in ``_errors``. Everything public is exported here.
"""

from __future__ import annotations

import contextlib as _contextlib
import importlib as _importlib
import importlib.metadata as _metadata
import typing as _typing

if _typing.TYPE_CHECKING:  # what the lazy loader below provides, for type checkers and IDEs
    from sharedml._errors import (
        CacheError,
        ExternalDataError,
        FamilyError,
        InvalidInputError,
        InvalidModelError,
        MeasurementError,
        ModelError,
        ModelNotFoundError,
        NotBatchableError,
        OutputError,
        PoolClosedError,
        PoolError,
        PoolTimeout,
        PrepareError,
        ProviderError,
        RunError,
        SessionCreationError,
        SharedMLError,
        UnsafePathError,
        WeightsMismatchError,
    )
    from sharedml.cache._root import Cache, cache_dir
    from sharedml.inspection._inspect import (
        Finding,
        InspectReport,
        PlacementSummary,
        TensorInfo,
        WeightsSummary,
        inspect,
    )
    from sharedml.inspection._measure import FixedCost, measure
    from sharedml.inspection._results import Measurement, MemoryPoint
    from sharedml.inspection._strategies import (
        Runner,
        SessionSet,
        Strategy,
        StrategyContext,
        register_strategy,
        registered_strategies,
    )
    from sharedml.model._inputs import ChosenSize, InputSpec
    from sharedml.model._tables import IndexedTable
    from sharedml.pool._batching import Batching
    from sharedml.pool._pool import PoolStats, SessionPool
    from sharedml.prepared._family import FamilyResult, TensorDigest
    from sharedml.prepared._prepare import (
        PrepareResult,
        SharedWeights,
        WeightsManifest,
        prepare,
        prepared_model_for,
        weights_path_for,
    )
    from sharedml.route._planner import Mechanism, Prepacking, SessionRecipe
    from sharedml.runtime._providers import ProviderPlan, ProviderSpec
    from sharedml.weights._device import DeviceWeightStore, HostWeights
    from sharedml.weights._probe import device_mechanism_available
    from sharedml.weights._store import TensorSlot, WeightStore, zero_copy_mechanisms

try:
    __version__ = _metadata.version("sharedml")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "__version__",
    # Preparing models
    "prepare",
    "PrepareResult",
    "FamilyResult",
    "TensorDigest",
    "WeightsManifest",
    "SharedWeights",
    "weights_path_for",
    "prepared_model_for",
    "cache_dir",
    "Cache",
    # Sharing weights
    "SessionPool",
    "PoolStats",
    "Batching",
    "SessionRecipe",
    "Mechanism",
    "Prepacking",
    "WeightStore",
    "TensorSlot",
    "zero_copy_mechanisms",
    "DeviceWeightStore",
    "HostWeights",
    "device_mechanism_available",
    "ProviderPlan",
    "ProviderSpec",
    # Inspecting: what N plain vs N shared sessions cost
    "inspect",
    "InspectReport",
    "Finding",
    "WeightsSummary",
    "PlacementSummary",
    "TensorInfo",
    "InputSpec",
    "ChosenSize",
    "IndexedTable",
    "FixedCost",
    "measure",
    "Measurement",
    "MemoryPoint",
    "Strategy",
    "StrategyContext",
    "SessionSet",
    "Runner",
    "register_strategy",
    "registered_strategies",
    # Errors
    "SharedMLError",
    "ModelError",
    "ModelNotFoundError",
    "InvalidModelError",
    "ExternalDataError",
    "UnsafePathError",
    "WeightsMismatchError",
    "PrepareError",
    "OutputError",
    "FamilyError",
    "CacheError",
    "ProviderError",
    "SessionCreationError",
    "RunError",
    "InvalidInputError",
    "NotBatchableError",
    "PoolError",
    "PoolClosedError",
    "PoolTimeout",
    "MeasurementError",
]


# Where each public name lives: loaded on first use (PEP 562), so that ``import sharedml`` and
# ``sharedml --help`` import neither onnx nor onnxruntime.
_ERRORS = (
    "SharedMLError ModelError ModelNotFoundError InvalidModelError ExternalDataError "
    "UnsafePathError WeightsMismatchError PrepareError OutputError FamilyError CacheError "
    "ProviderError "
    "SessionCreationError RunError InvalidInputError NotBatchableError PoolError "
    "PoolClosedError PoolTimeout MeasurementError"
)
_HOMES = {
    "pool._batching": "Batching",
    "cache._root": "Cache cache_dir",
    "weights._device": "DeviceWeightStore HostWeights",
    "weights._probe": "device_mechanism_available",
    "_errors": _ERRORS,
    "prepared._family": "FamilyResult TensorDigest",
    "model._inputs": "ChosenSize InputSpec",
    "model._tables": "IndexedTable",
    "inspection._inspect": (
        "Finding InspectReport PlacementSummary TensorInfo WeightsSummary inspect"
    ),
    "inspection._measure": "FixedCost measure",
    "pool._pool": "PoolStats SessionPool",
    "prepared._prepare": (
        "PrepareResult SharedWeights WeightsManifest prepare prepared_model_for weights_path_for"
    ),
    "runtime._providers": "ProviderPlan ProviderSpec",
    "inspection._results": "Measurement MemoryPoint",
    "route._planner": "Mechanism Prepacking SessionRecipe",
    "inspection._strategies": (
        "Runner SessionSet Strategy StrategyContext register_strategy registered_strategies"
    ),
    "weights._store": "TensorSlot WeightStore zero_copy_mechanisms",
}
_LAZY = {name: module for module, names in _HOMES.items() for name in names.split()}


def __getattr__(name: str) -> _typing.Any:
    """Import a public name's module on first use and name ``sharedml`` as the object's home.

    ``help()``, reprs and tracebacks then send users to ``sharedml.SessionPool``, not to the
    private module it happens to live in (onnx-ir does the same); pickles refer to the public
    name too.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sharedml' has no attribute {name!r}")
    obj = getattr(_importlib.import_module(f"sharedml.{module}"), name)
    home = getattr(obj, "__module__", "") or ""
    if home.startswith("sharedml.") and any(p.startswith("_") for p in home.split(".")):
        with _contextlib.suppress(AttributeError, TypeError):  # typing aliases refuse
            obj.__module__ = __name__
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# The errors are cheap to import and raised from deep inside: they name their public home from
# the start, so that a traceback says ``sharedml.PoolClosedError`` before anyone looked it up.
for _name in _ERRORS.split():
    __getattr__(_name)
del _name
