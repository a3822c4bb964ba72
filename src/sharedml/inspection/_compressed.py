"""What compressed weights cost in accuracy, against the float model on the inputs inspect used.

``sharedml inspect --compress int4`` measures the compressed pool's memory and run time as one
more strategy (``shared-int4``, :mod:`sharedml.inspection._strategies`); this module adds the
accuracy: the compressed model runs once in a fresh process on the very inputs of the float
trial run (:func:`sharedml.inspection._measure.trial_run`), and the two sets of outputs are
compared here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sharedml.inspection._measure import trial_run
from sharedml.model._accuracy import OutputAccuracy, compare_outputs
from sharedml.model._inputs import InputSpec
from sharedml.prepared._compress import WeightsFormat

__all__ = ["CompressedAccuracy", "OutputAccuracy", "compare_outputs", "compressed_accuracy"]


@dataclasses.dataclass(frozen=True)
class CompressedAccuracy:
    """The compressed model against the float model, on the inputs inspect used.

    Attributes:
        weights: The format (``"int8"``, ``"int4"``).
        model_path: The compressed, prepared model (a cache entry).
        strategy: The strategy that measured its memory and run time (``shared-int4``).
        outputs: One :class:`OutputAccuracy` per numeric output.
        error: Why there is no comparison (the compressed model failed to run), else None.
    """

    weights: str
    model_path: Path
    strategy: str
    outputs: tuple[OutputAccuracy, ...] = ()
    error: str | None = None

    @property
    def max_abs_diff(self) -> float | None:
        """The largest absolute difference over every output."""
        return max((o.max_abs_diff for o in self.outputs), default=None)

    @property
    def max_rel_diff(self) -> float | None:
        """The largest relative difference (to each output's scale) over every output."""
        return max((o.max_rel_diff for o in self.outputs), default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "weights": self.weights,
            "model": str(self.model_path),
            "strategy": self.strategy,
            "max_abs_diff": self.max_abs_diff,
            "max_rel_diff": self.max_rel_diff,
            "outputs": [o.to_dict() for o in self.outputs],
            "error": self.error,
        }


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as saved:
        return {name: saved[name] for name in saved.files}


def compressed_accuracy(
    compressed: Path,
    weights: WeightsFormat,
    *,
    reference: Path,
    inputs: Sequence[InputSpec],
    scratch: Path,
    providers: Sequence[Any],
    provider_options: Sequence[dict[str, Any]],
    ep_libraries: Mapping[str, Any] | None = None,
    ep_devices: Mapping[str, Any] | None = None,
    feeds: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
) -> CompressedAccuracy:
    """Run the compressed model once on the float run's inputs and compare the outputs.

    Args:
        compressed: The compressed model (from
            :func:`~sharedml.prepared._compress.compressed_model_for`).
        weights: Its format.
        reference: The float trial run's outputs (``.npz``).
        inputs: The inputs of that run (generated inputs are deterministic).
        scratch: A folder for the compressed run's outputs.
        providers: As for the trial run.
        provider_options: As for the trial run.
        ep_libraries: As for the trial run.
        ep_devices: As for the trial run.
        feeds: As for the trial run.
        timeout_s: Stop the run after this long.
    """
    path = compressed
    strategy = f"shared-{weights.value}"
    trial = trial_run(
        path,
        inputs=inputs,
        reference=scratch / f"{weights.value}-outputs.npz",
        providers=providers,
        provider_options=provider_options,
        ep_libraries=ep_libraries,
        ep_devices=ep_devices,
        feeds=feeds,
        timeout_s=timeout_s,
    )
    if trial.error is not None or trial.reference is None:
        return CompressedAccuracy(weights.value, path, strategy, error=trial.error)
    outputs = compare_outputs(_load(reference), _load(trial.reference))
    return CompressedAccuracy(weights.value, path, strategy, outputs=outputs)
