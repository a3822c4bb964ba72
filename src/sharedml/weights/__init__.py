"""Weights mapped once per process and lent to every session.

The host store, the device store, DLPack, the device-route probes, and ORT's prepacked
weights.

Public (for integrators): the host and device stores and what lends bytes without a copy;
``__init__.pyi`` lists the names.
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
