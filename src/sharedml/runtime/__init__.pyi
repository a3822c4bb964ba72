from sharedml.runtime._plugins import DeviceSelector as DeviceSelector
from sharedml.runtime._plugins import PluginDevice as PluginDevice
from sharedml.runtime._providers import PROVIDER_FACTS as PROVIDER_FACTS
from sharedml.runtime._providers import ProviderFacts as ProviderFacts
from sharedml.runtime._providers import ProviderPlan as ProviderPlan
from sharedml.runtime._providers import ProviderSpec as ProviderSpec
from sharedml.runtime._providers import RunsRule as RunsRule
from sharedml.runtime._providers import WeightsRoute as WeightsRoute

__all__: list[str]
