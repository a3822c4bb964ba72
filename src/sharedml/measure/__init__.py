"""Measuring sessions, for strategy plug-in authors and for what ``inspect`` reports.

``measure()`` runs one strategy's sessions in a fresh process and returns a
:class:`Measurement`; a :class:`Strategy` says how its sessions are made and run
(``register_strategy`` adds one to ``sharedml inspect``); the report's parts
(:class:`WeightsSummary`, :class:`PlacementSummary`, ...) are what :class:`sharedml.InspectReport`
holds. ``__init__.pyi`` lists the names.
"""

import sys as _sys
import types as _types
from typing import Any as _Any

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)


class _Module(_types.ModuleType):
    """``sharedml.measure`` is a module: calling it says which function measures."""

    def __call__(self, *args: _Any, **kwargs: _Any) -> _Any:
        raise TypeError(
            "sharedml.measure is a module, not a function: call sharedml.measure.measure(...)."
        )


_sys.modules[__name__].__class__ = _Module
