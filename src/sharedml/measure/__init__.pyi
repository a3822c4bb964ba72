from typing import Any

from sharedml.inspection._inspect import PlacementSummary as PlacementSummary
from sharedml.inspection._inspect import TensorInfo as TensorInfo
from sharedml.inspection._inspect import WeightsSummary as WeightsSummary
from sharedml.inspection._measure import FixedCost as FixedCost
from sharedml.inspection._measure import measure as measure
from sharedml.inspection._results import Measurement as Measurement
from sharedml.inspection._results import MemoryPoint as MemoryPoint
from sharedml.inspection._strategies import Runner as Runner
from sharedml.inspection._strategies import SessionSet as SessionSet
from sharedml.inspection._strategies import Strategy as Strategy
from sharedml.inspection._strategies import StrategyContext as StrategyContext
from sharedml.inspection._strategies import register_strategy as register_strategy
from sharedml.inspection._strategies import registered_strategies as registered_strategies
from sharedml.model._inputs import ChosenSize as ChosenSize
from sharedml.model._tables import IndexedTable as IndexedTable

__all__: list[str]

def __call__(*args: Any, **kwargs: Any) -> Measurement: ...
