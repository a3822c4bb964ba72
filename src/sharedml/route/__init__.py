"""The route planner.

How a pool's sessions get the shared weights (a :class:`SessionRecipe`).

Public (for integrators): the recipe a pool's sessions are made from; ``__init__.pyi`` lists
the names.
"""

from sharedml import _exports

__all__, __getattr__, __dir__ = _exports.attach(__name__)
