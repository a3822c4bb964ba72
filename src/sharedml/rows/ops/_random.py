"""Random operators: refused, since a merged run draws other numbers for every row."""

from __future__ import annotations

from sharedml.rows._facts import Fact
from sharedml.rows._registry import Node, Refused, rule

_RANDOM = (  # noqa: SIM905 (a table: one name each, compact)
    "RandomNormal RandomNormalLike RandomUniform RandomUniformLike Bernoulli Multinomial"
).split()


@rule(*_RANDOM, summary="random: refused (a merged run draws other numbers for every row)")
def _random(n: Node) -> Fact:
    raise Refused("draws random numbers: a merged run would give each row other draws")
