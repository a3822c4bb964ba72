"""Prepared models: what prepare writes.

Every weight of a model (or a family of models) in one aligned, verified file beside a small
graph. ``_plan``: which tensors move; ``_source``: reading the source once, hashed;
``_format``: the weights-file format (save and load); ``_files``: temporary files and atomic
replaces; ``_prepare``: ``prepare`` and the cache's prepared entries; ``_family``: several
models over one file; ``_dedupe``: tensors shared with other cache entries.
"""
