"""``/metrics`` of ``sharedml serve``: requests, errors, latency, queue, batches, pool counters.

Written with ``prometheus_client`` (the Prometheus project's own Python library) into a registry
of the server's own, so several servers in one process (tests) never share series.

- Per request, measured by the server (HTTP and gRPC alike): ``sharedml_requests_total`` and
  ``sharedml_request_errors_total`` by model, protocol and status code, and the latency
  histogram ``sharedml_request_seconds`` (queue and run).
- Per model, read from ``pool.stats()`` when Prometheus scrapes (a collector, so the numbers
  are the pool's own, never a second count of them): sessions, busy sessions, requests
  waiting (the queue), runs and failed runs, queued requests and their seconds, batches and
  their rows (mean batch = rows / batches) and the largest batch, run seconds, and whether the
  pool merges requests. The pool keeps totals, not one event per batch, so batch sizes are a
  mean and a maximum rather than a histogram (as in ``sharedml.ray``'s metrics).
- ``sharedml_inflight_bytes``: what the requests in flight hold of the byte budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from sharedml.pool._stats import COUNTERS, GAUGES
from sharedml.serve._models import ServedModel

__all__ = ["LATENCY_BUCKETS_S", "ServerMetrics"]

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# PoolStats field -> (metric name, help): pool/_stats.py's table, as this server names them.
_COUNTERS = {field: (f"sharedml_pool_{stem}", text) for field, (stem, text) in COUNTERS.items()}
_GAUGES = {field: (f"sharedml_pool_{stem}", text) for field, (stem, text) in GAUGES.items()}


class _PoolCollector:
    """Reads every model's ``pool.stats()`` at scrape time."""

    def __init__(self, models: Mapping[str, ServedModel], inflight: Callable[[], int]) -> None:
        self._models = models
        self._inflight = inflight

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = {name: model.pool.stats() for name, model in self._models.items()}
        for field, (name, text) in _COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=["model"])
            for model, values in stats.items():
                if hasattr(values, field):
                    family.add_metric([model], float(getattr(values, field)))
            yield family
        for field, (name, text) in _GAUGES.items():
            gauge = GaugeMetricFamily(name, text, labels=["model"])
            for model, values in stats.items():
                if hasattr(values, field):
                    gauge.add_metric([model], float(getattr(values, field)))
            yield gauge
        yield GaugeMetricFamily(
            "sharedml_inflight_bytes",
            "Bytes the requests in flight hold of the server's budget (HttpLimits).",
            value=float(self._inflight()),
        )


class ServerMetrics:
    """The server's Prometheus registry: what it observes per request, what pools report.

    Args:
        models: The served models.
        inflight: Returns the bytes the requests in flight hold now.

    Thread safety: :meth:`observe` and :meth:`render` may be called from any thread.
    """

    def __init__(self, models: Mapping[str, ServedModel], inflight: Callable[[], int]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        labels = ["model", "protocol", "code"]
        self._requests = Counter(
            "sharedml_requests",
            "Inference requests answered, by model, protocol and status code.",
            labels,
            registry=self.registry,
        )
        self._errors = Counter(
            "sharedml_request_errors",
            "Inference requests answered with an error (HTTP 4xx/5xx, gRPC non-OK).",
            labels,
            registry=self.registry,
        )
        self._latency = Histogram(
            "sharedml_request_seconds",
            "Seconds from a request's arrival to its reply (reading, queue, run, encoding).",
            ["model", "protocol"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(models, inflight))

    def observe(self, model: str, protocol: str, code: str, seconds: float) -> None:
        """Count one request (the server's observer)."""
        self._requests.labels(model, protocol, code).inc()
        if code not in ("200", "OK"):
            self._errors.labels(model, protocol, code).inc()
        self._latency.labels(model, protocol).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
