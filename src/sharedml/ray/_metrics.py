"""A replica's pool counters as Ray metrics (Prometheus, through each node's metrics agent).

Ray exports ``ray.util.metrics`` objects with a ``ray_`` prefix (counters also get ``_total``),
one series per replica, tagged with the model, application, deployment and replica. So
``sum(rate(ray_sharedml_requests_total[1m]))`` is a deployment's request rate and
``rate(ray_sharedml_batched_rows_total) / rate(ray_sharedml_batches_total)`` its mean batch.

Decisions:

- The pool's counters are cumulative (:class:`~sharedml.PoolStats`); :meth:`PoolMetrics.record`
  adds the difference since the last call to each Ray counter, so exporting costs one ``stats()``
  per request and counts every run once, whoever records.
- The pool reports totals, not one event per batch or per queued request, so batch sizes are
  exported as rows and batches (their ratio is the mean) plus the largest batch, and queue time
  as total seconds queued and requests queued. The request latency histogram is measured by the
  server around each request (queue and run together).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from sharedml.pool._pool import PoolStats
from sharedml.pool._stats import COUNTERS, GAUGES

__all__ = ["LATENCY_BUCKETS_S", "TAG_KEYS", "PoolMetrics"]

TAG_KEYS = ("model", "application", "deployment", "replica")
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# PoolStats field -> (Ray metric name, description): pool/_stats.py's table, named as Ray
# exports them (Ray adds its own "ray_" in front).
_COUNTERS = {field: (f"sharedml_{stem}", text) for field, (stem, text) in COUNTERS.items()}
_GAUGES = {field: (f"sharedml_{stem}", text) for field, (stem, text) in GAUGES.items()}


class PoolMetrics:
    """Exports one pool's :class:`~sharedml.PoolStats` as Ray metrics.

    Example (in a deployment's constructor and request handler)::

        self.metrics = PoolMetrics({"model": "mlp", "replica": replica_id})
        ...
        self.metrics.record(self.pool.stats(), latency_s=time.perf_counter() - start)

    Args:
        tags: Values for :data:`TAG_KEYS` (missing keys are exported empty).

    Thread safety: :meth:`record` may be called from any thread.
    """

    def __init__(self, tags: Mapping[str, str]) -> None:
        from ray.util import metrics

        defaults = {key: str(tags.get(key, "")) for key in TAG_KEYS}
        self._counters: dict[str, Any] = {}
        self._gauges: dict[str, Any] = {}
        for field, (name, description) in _COUNTERS.items():
            self._counters[field] = metrics.Counter(name, description, tag_keys=TAG_KEYS)
        for field, (name, description) in _GAUGES.items():
            self._gauges[field] = metrics.Gauge(name, description, tag_keys=TAG_KEYS)
        self._latency = metrics.Histogram(
            "sharedml_request_seconds",
            "Seconds from a request's arrival at the replica to its outputs (queue and run).",
            boundaries=list(LATENCY_BUCKETS_S),
            tag_keys=TAG_KEYS,
        )
        for metric in (*self._counters.values(), *self._gauges.values(), self._latency):
            metric.set_default_tags(defaults)
        self._last: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)
        self._lock = threading.Lock()

    def record(self, stats: PoolStats, *, latency_s: float | None = None) -> None:
        """Export ``stats`` (a fresh ``pool.stats()``), and one request's latency if given."""
        with self._lock:
            for field, counter in self._counters.items():
                value = float(getattr(stats, field))
                delta = value - self._last[field]
                if delta > 0:  # Ray counters refuse increments <= 0
                    counter.inc(delta)
                    self._last[field] = value
            for field, gauge in self._gauges.items():
                gauge.set(float(getattr(stats, field)))
        if latency_s is not None:
            self._latency.observe(latency_s)
