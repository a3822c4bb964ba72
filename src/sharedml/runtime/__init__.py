"""The installed onnxruntime.

What it can do (capabilities, probed once per process), its execution providers, the
session options sharedml copies and sets, and its weight quantizer.

Public (for integrators): the execution-provider plan a pool runs with, the provider table
(:data:`PROVIDER_FACTS`: what sharedml knows of each provider), and the device selector of
plugin execution providers; ``__init__.pyi`` lists the names.
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
