"""A strategy for tests whose outputs are a plain session's plus one: the numerics check sees it.

Its factory runs in the measuring child, which imports this module by name (tests/ is on the
child's path).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sharedml.inspection._strategies import Runner, SessionSet, StrategyContext


class _Offset:
    def __init__(self, ctx: StrategyContext) -> None:
        import onnxruntime as ort

        self._sess = ort.InferenceSession(str(ctx.model_path), providers=list(ctx.providers))

    def add(self) -> Runner:
        def run(feeds: Mapping[str, Any]) -> object:
            return [out + 1 for out in self._sess.run(None, dict(feeds))]

        return run

    def close(self) -> None:
        del self._sess


def offset(ctx: StrategyContext) -> SessionSet:
    return _Offset(ctx)
