"""Measuring sessions, for strategy plug-in authors and for what ``inspect`` reports.

``measure()`` runs one strategy's sessions in a fresh process and returns a
:class:`Measurement`; a :class:`Strategy` says how its sessions are made and run
(``register_strategy`` adds one to ``sharedml inspect``); the report's parts
(:class:`WeightsSummary`, :class:`PlacementSummary`, ...) are what :class:`sharedml.InspectReport`
holds. ``__init__.pyi`` lists the names.
"""

import sys as _sys
import types as _types
import warnings as _warnings
from typing import Any as _Any

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)


class _CallableModule(_types.ModuleType):
    """``sharedml.measure`` was a function before it was this module: calls still work."""

    def __call__(self, *args: _Any, **kwargs: _Any) -> _Any:
        _warnings.warn(
            "sharedml.measure(...) is now the module sharedml.measure: call "
            "sharedml.measure.measure(...); the old spelling goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.measure(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
