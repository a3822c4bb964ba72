"""SessionPool: sessions that serve callers from any thread.

The pool's lifecycle, the scheduler (tickets, batch forming), batching (merging and splitting
requests where the row-independence analysis of :mod:`sharedml.rows` proves that they may
merge), session creation, run locks, CUDA graphs and the pool's counters.

Public (for wrappers such as ``sharedml.ray``): ``__init__.pyi`` lists the names; the top level
has the common ones.
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
