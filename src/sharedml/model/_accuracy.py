"""How far one model's outputs are from another's: compressed against float, on given inputs.

Used by ``sharedml inspect --compress`` (:mod:`sharedml.inspection._compressed`) and by
:func:`sharedml.prepared.compress_static`, which reports the accuracy its calibration cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["OutputAccuracy", "compare_outputs", "worst_of"]


@dataclasses.dataclass(frozen=True)
class OutputAccuracy:
    """How far one output of the compressed model is from the float model's.

    Attributes:
        name: The output (``out0``, ``out1``...: by position, as the trial run saves them).
        max_abs_diff: The largest absolute difference.
        max_rel_diff: ``max_abs_diff`` over the float output's largest magnitude (a relative
            difference per element is meaningless where the float value is near 0).
        top1_agreement: For a classifier-like output (float, shape ``[rows, classes]`` with at
            least 2 classes): the share of rows whose largest class is the same; else None.
        top1_rows: How many rows that share is of (0 where not classifier-like).
    """

    name: str
    max_abs_diff: float
    max_rel_diff: float
    top1_agreement: float | None
    top1_rows: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dataclasses.asdict(self)


def compare_outputs(
    reference: Mapping[str, np.ndarray], other: Mapping[str, np.ndarray]
) -> tuple[OutputAccuracy, ...]:
    """Compare each float output of ``reference`` with ``other``'s of the same name and shape.

    Outputs that are not floats, or whose shapes differ, are left out.
    """
    found = []
    for name, want in reference.items():
        got = other.get(name)
        if got is None or got.shape != want.shape or want.dtype.kind != "f" or not want.size:
            continue
        want64, got64 = want.astype(np.float64), got.astype(np.float64)
        diff = float(np.max(np.abs(got64 - want64)))
        scale = float(np.max(np.abs(want64)))
        classifier = want.ndim == 2 and want.shape[1] >= 2
        agreement = (
            float(np.mean(np.argmax(got64, axis=1) == np.argmax(want64, axis=1)))
            if classifier
            else None
        )
        found.append(
            OutputAccuracy(
                name=name,
                max_abs_diff=diff,
                max_rel_diff=diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")),
                top1_agreement=agreement,
                top1_rows=int(want.shape[0]) if classifier else 0,
            )
        )
    return tuple(found)


def worst_of(per_feed: Sequence[Sequence[OutputAccuracy]]) -> tuple[OutputAccuracy, ...]:
    """One :class:`OutputAccuracy` per output over several feeds' comparisons.

    The largest differences of any feed (each relative to its own feed's scale), and the
    top-1 agreement over all the feeds' rows.
    """
    found: dict[str, list[OutputAccuracy]] = {}
    for outputs in per_feed:
        for o in outputs:
            found.setdefault(o.name, []).append(o)
    merged = []
    for name, seen in found.items():
        rows = sum(o.top1_rows for o in seen)
        agreed = sum((o.top1_agreement or 0.0) * o.top1_rows for o in seen)
        merged.append(
            OutputAccuracy(
                name=name,
                max_abs_diff=max(o.max_abs_diff for o in seen),
                max_rel_diff=max(o.max_rel_diff for o in seen),
                top1_agreement=agreed / rows if rows else None,
                top1_rows=rows,
            )
        )
    return tuple(merged)
