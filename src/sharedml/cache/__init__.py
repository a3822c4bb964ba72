"""The content-keyed cache of prepared models and derived entries (``$SHAREDML_CACHE_DIR``).

Public: ``__init__.pyi`` lists the names.
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
