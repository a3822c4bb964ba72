"""Prepared models: what prepare writes.

Every weight of a model (or a family of models) in one aligned, verified file beside a small
graph: the plan, the weights-file format, the writer, families, and the tensors shared with
other cache entries.

Public: prepare and its results, the weights-file manifest, and the cache lookups of
prepared models; ``__init__.pyi`` lists the names (the top level has the common ones).
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
