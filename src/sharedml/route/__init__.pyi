from sharedml.route._planner import Mechanism as Mechanism
from sharedml.route._planner import Prepacking as Prepacking
from sharedml.route._planner import SessionRecipe as SessionRecipe

__all__: list[str]
