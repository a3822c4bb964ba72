"""Output comparison: how far a compressed model's outputs are from the float model's."""

from __future__ import annotations

import numpy as np
import pytest

from sharedml.model._accuracy import compare_outputs, worst_of


def test_several_feeds_give_their_largest_differences_and_the_agreement_over_all_rows() -> None:
    want_a = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)  # scale 2
    want_b = np.array([[4.0, 0.0], [0.0, 1.0], [3.0, 1.0]], np.float32)  # scale 4
    got_a = want_a + np.array([[0.0, 0.0], [3.0, 0.0]], np.float32)  # row 2 flips: 1 of 2
    got_b = want_b + np.array([[0.0, 0.5], [0.0, 0.0], [0.0, 0.0]], np.float32)  # 3 of 3
    (merged,) = worst_of(
        [compare_outputs({"y": want_a}, {"y": got_a}), compare_outputs({"y": want_b}, {"y": got_b})]
    )
    assert merged.max_abs_diff == pytest.approx(3.0)
    assert merged.max_rel_diff == pytest.approx(1.5)  # 3 over feed a's scale of 2
    assert (merged.top1_agreement, merged.top1_rows) == (pytest.approx(4 / 5), 5)
    (later,) = worst_of(
        [compare_outputs({"y": want_b}, {"y": got_b}), compare_outputs({"y": want_a}, {"y": got_a})]
    )
    assert later == merged  # the worst feed counts wherever it comes
