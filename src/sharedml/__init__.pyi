"""The names an application needs, read by type checkers and by ``sharedml._exports``.

Integrators and plug-in authors import the public modules named at the end.
"""

from sharedml import cache as cache
from sharedml import measure as measure
from sharedml import pool as pool
from sharedml import prepared as prepared
from sharedml import route as route
from sharedml import runtime as runtime
from sharedml import weights as weights
from sharedml._errors import (
    CacheError as CacheError,
)
from sharedml._errors import (
    CompressError as CompressError,
)
from sharedml._errors import (
    ExternalDataError as ExternalDataError,
)
from sharedml._errors import (
    FamilyError as FamilyError,
)
from sharedml._errors import (
    InvalidInputError as InvalidInputError,
)
from sharedml._errors import (
    InvalidModelError as InvalidModelError,
)
from sharedml._errors import (
    MeasurementError as MeasurementError,
)
from sharedml._errors import (
    ModelError as ModelError,
)
from sharedml._errors import (
    ModelNotFoundError as ModelNotFoundError,
)
from sharedml._errors import (
    NotBatchableError as NotBatchableError,
)
from sharedml._errors import (
    OutputError as OutputError,
)
from sharedml._errors import (
    PoolClosedError as PoolClosedError,
)
from sharedml._errors import (
    PoolError as PoolError,
)
from sharedml._errors import (
    PoolTimeout as PoolTimeout,
)
from sharedml._errors import (
    PrepareError as PrepareError,
)
from sharedml._errors import (
    ProviderError as ProviderError,
)
from sharedml._errors import (
    RunError as RunError,
)
from sharedml._errors import (
    SessionCreationError as SessionCreationError,
)
from sharedml._errors import (
    SharedMLError as SharedMLError,
)
from sharedml._errors import (
    UnsafePathError as UnsafePathError,
)
from sharedml._errors import (
    UnsupportedModelError as UnsupportedModelError,
)
from sharedml._errors import (
    WeightsMismatchError as WeightsMismatchError,
)
from sharedml.cache._root import cache_dir as cache_dir
from sharedml.inspection._inspect import Finding as Finding
from sharedml.inspection._inspect import InspectReport as InspectReport
from sharedml.inspection._inspect import inspect as inspect
from sharedml.model._inputs import InputSpec as InputSpec
from sharedml.pool._batching import Batching as Batching
from sharedml.pool._calibrate import Calibration as Calibration
from sharedml.pool._pool import SessionPool as SessionPool
from sharedml.pool._stats import PoolStats as PoolStats
from sharedml.prepared._family import FamilyResult as FamilyResult
from sharedml.prepared._family import prepare_family as prepare_family
from sharedml.prepared._prepare import PrepareResult as PrepareResult
from sharedml.prepared._prepare import prepare as prepare
from sharedml.prepared._prepare import prepared_model_for as prepared_model_for

__version__: str
__all__: list[str]
