"""A daemon's Prometheus metric families, named ``outboxkit_<kind>_<name>``, in a registry of
their own (never the global one: two daemons in one test process must not collide)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class MetricFamilies:
    def __init__(self, kind: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._prefix = f"outboxkit_{kind}_"

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self._prefix + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(self._prefix + name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: Sequence[float],
                  labels: Sequence[str] = ()) -> Histogram:
        return Histogram(self._prefix + name, doc, labels, buckets=buckets,
                         registry=self.registry)
