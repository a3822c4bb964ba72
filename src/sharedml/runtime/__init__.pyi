from sharedml.runtime._providers import ProviderPlan as ProviderPlan
from sharedml.runtime._providers import ProviderSpec as ProviderSpec

__all__: list[str]
