"""The content-keyed cache of prepared models and derived entries (``$SHAREDML_CACHE_DIR``)."""
