from sharedml.cache._cache import cache_dir as cache_dir

__all__: list[str]
