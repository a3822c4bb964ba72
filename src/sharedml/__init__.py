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
import importlib.metadata as _metadata

from sharedml._batching import Batching
from sharedml._cache import cache_dir
from sharedml._device import DeviceWeightStore, HostWeights
from sharedml._device_probe import device_mechanism_available
from sharedml._errors import (
    CacheError,
    ExternalDataError,
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
from sharedml._inputs import InputSpec
from sharedml._inspect import InspectReport, PlacementSummary, TensorInfo, WeightsSummary, inspect
from sharedml._measure import measure
from sharedml._pool import PoolStats, SessionPool
from sharedml._prepare import (
    PrepareResult,
    WeightsManifest,
    prepare,
    prepared_model_for,
    weights_path_for,
)
from sharedml._providers import ProviderPlan, ProviderSpec
from sharedml._results import Measurement, MemoryPoint
from sharedml._route import Mechanism, Prepacking, SessionRecipe
from sharedml._strategies import (
    Runner,
    SessionSet,
    Strategy,
    StrategyContext,
    register_strategy,
    registered_strategies,
)
from sharedml._weights import TensorSlot, WeightStore, zero_copy_mechanisms

try:
    __version__ = _metadata.version("sharedml")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "__version__",
    # Preparing models
    "prepare",
    "PrepareResult",
    "WeightsManifest",
    "weights_path_for",
    "prepared_model_for",
    "cache_dir",
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
    "WeightsSummary",
    "PlacementSummary",
    "TensorInfo",
    "InputSpec",
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


def _claim_public_names() -> None:
    """Name ``sharedml`` as the home of every public object (onnx-ir does the same).

    help(), reprs and tracebacks then send users to ``sharedml.SessionPool``, not to the private
    module it happens to live in; pickles refer to the public name too.
    """
    for name in __all__:
        obj = globals()[name]
        if getattr(obj, "__module__", "").startswith("sharedml._"):
            with _contextlib.suppress(AttributeError, TypeError):  # typing aliases refuse
                obj.__module__ = __name__


_claim_public_names()
