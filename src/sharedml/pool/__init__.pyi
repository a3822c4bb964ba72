from sharedml.pool._batching import Batching as Batching
from sharedml.pool._batching import BatchingDefault as BatchingDefault
from sharedml.pool._batching import BatchingSetting as BatchingSetting
from sharedml.pool._calibrate import Calibration as Calibration
from sharedml.pool._calibrate import CalibrationCandidate as CalibrationCandidate
from sharedml.pool._options import DEFAULT_SESSIONS as DEFAULT_SESSIONS
from sharedml.pool._pool import SessionPool as SessionPool
from sharedml.pool._stats import PoolStats as PoolStats

__all__: list[str]
