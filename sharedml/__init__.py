"""sharedml: many ONNX Runtime sessions, one copy of the weights.

The data flow, module by module::

    model.onnx --prepare (_prepare)--> model.onnx + model.weights (one aligned file)
               --WeightStore (_weights)--> mapped once per process
               --SessionPool (_pool, _providers)--> N sessions borrowing the mapped bytes
               --inspect (_inspect, _measure)--> what N plain vs N shared sessions cost
"""

from __future__ import annotations

import importlib.metadata as _metadata

from sharedml._cache import cache_dir, prepared_model_for
from sharedml._device import DeviceWeightStore, device_mechanism_available
from sharedml._errors import (
    ExternalDataError,
    InvalidModelError,
    MeasurementError,
    ModelError,
    ModelNotFoundError,
    PoolClosedError,
    PoolError,
    PoolTimeout,
    PrepareError,
    ProviderError,
    SessionCreationError,
    SharedMLError,
    UnsafePathError,
    WeightsMismatchError,
)
from sharedml._inspect import InspectReport, inspect
from sharedml._measure import (
    Measurement,
    MemoryPoint,
    Strategy,
    StrategyContext,
    register_strategy,
    registered_strategies,
)
from sharedml._pool import PoolStats, SessionPool
from sharedml._prepare import PrepareResult, WeightsManifest, prepare, weights_path_for
from sharedml._weights import WeightStore, zero_copy_mechanisms

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
    "WeightStore",
    "zero_copy_mechanisms",
    "DeviceWeightStore",
    "device_mechanism_available",
    # Inspecting: what N plain vs N shared sessions cost
    "inspect",
    "InspectReport",
    "Measurement",
    "MemoryPoint",
    "Strategy",
    "StrategyContext",
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
    "ProviderError",
    "SessionCreationError",
    "PoolError",
    "PoolClosedError",
    "PoolTimeout",
    "MeasurementError",
]
