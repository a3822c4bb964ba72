from sharedml.weights._device import DeviceWeightStore as DeviceWeightStore
from sharedml.weights._device import HostWeights as HostWeights
from sharedml.weights._probe import device_mechanism_available as device_mechanism_available
from sharedml.weights._store import TensorSlot as TensorSlot
from sharedml.weights._store import WeightStore as WeightStore
from sharedml.weights._store import zero_copy_mechanisms as zero_copy_mechanisms

__all__: list[str]
