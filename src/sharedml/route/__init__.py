"""The route planner.

How a pool's sessions get the shared weights (a :class:`SessionRecipe`).
"""
