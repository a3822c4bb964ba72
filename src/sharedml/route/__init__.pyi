from sharedml.route._options import Mechanism as Mechanism
from sharedml.route._options import Prepacking as Prepacking
from sharedml.route._planner import SessionRecipe as SessionRecipe

__all__: list[str]
