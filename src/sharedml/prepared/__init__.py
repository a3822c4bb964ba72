"""Prepared models: what prepare writes.

Every weight of a model (or a family of models) in one aligned, verified file beside a small
graph. ``_plan``: which tensors move; ``_source``: reading the source once, hashed;
``_format``: the weights-file format (save and load); ``_files``: temporary files and atomic
replaces; ``_prepare``: ``prepare`` and the cache's prepared entries; ``_family``: several
models over one file; ``_dedupe``: tensors shared with other cache entries.

Public: prepare and its results, the weights-file manifest, and the cache lookups of
prepared models; ``__init__.pyi`` lists the names (the top level has the common ones).
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
