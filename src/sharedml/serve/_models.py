"""A served model: a name, its pool, and its tensors as the wire formats describe them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from sharedml.protocol._metadata import model_metadata
from sharedml.protocol._tensors import TensorInfo, tensor_infos

__all__ = ["ServedModel"]


class ServedModel:
    """One model behind a server: every request of every wire format runs on its one pool.

    Args:
        name: The name clients use (``/v2/models/<name>``).
        pool: The model's :class:`~sharedml.SessionPool` (any object with ``run_async``,
            ``get_inputs``, ``get_outputs``, ``closed`` and ``stats``).
        on_run: Called after each run with its seconds (queue and run), whether it failed or
            not: the server's metrics.

    Thread safety: :meth:`infer` may be awaited from any number of requests at once.
    """

    def __init__(
        self, name: str, pool: Any, *, on_run: Callable[[float], None] | None = None
    ) -> None:
        self.name = name
        self.pool = pool
        self.inputs: dict[str, TensorInfo] = tensor_infos(pool.get_inputs())
        self.outputs: dict[str, TensorInfo] = tensor_infos(pool.get_outputs())
        self.draining = False
        self._on_run = on_run

    @property
    def ready(self) -> bool:
        """Whether the model takes requests: its pool is open and the server is not stopping."""
        return not self.draining and not self.pool.closed

    def metadata(self) -> dict[str, Any]:
        """The Open Inference Protocol's model metadata."""
        return model_metadata(self.name, self.inputs, self.outputs)

    async def infer(
        self, feed: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the model on ``feed``; the outputs by name (all, or ``output_names``).

        Raises:
            InvalidInputError: the feed does not fit the model's inputs.
            RunError: onnxruntime failed the run.
            PoolClosedError: the pool is closed.
        """
        names = list(output_names) if output_names is not None else None
        start = time.perf_counter()
        try:
            values = await self.pool.run_async(names, dict(feed))
        finally:
            if self._on_run is not None:
                self._on_run(time.perf_counter() - start)
        return dict(zip(names or self.outputs, values, strict=True))
