"""Random operators: refused, since a merged run draws other numbers for every row."""

from __future__ import annotations

from sharedml.rows._facts import Fact
from sharedml.rows._registry import Node, Refused, rule, summary


@rule("", "RandomNormal", since=1)
@rule("", "RandomNormalLike", since=1)
@rule("", "RandomUniform", since=1)
@rule("", "RandomUniformLike", since=1)
@rule("", "Bernoulli", since=15)
@rule("", "Multinomial", since=7)
@summary("random: refused (a merged run draws other numbers for every row)")
def _random(n: Node) -> Fact:
    raise Refused("draws random numbers: a merged run would give each row other draws")
