"""The relay's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Where a transient error came from: the label values of outboxkit_relay_transient_errors_total.
TRANSIENT_SOURCES = ("kafka", "postgres")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RelayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.backlog = Gauge(
            "outboxkit_relay_backlog_messages",
            "Outbox rows waiting to be published (all lanes).",
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "outboxkit_relay_oldest_pending_age_seconds",
            "Age of the oldest pending outbox row (0 when none).",
            registry=r,
        )
        self.failed_rows = Gauge(
            "outboxkit_relay_failed_messages",
            "Outbox rows marked failed, waiting for an operator.",
            registry=r,
        )
        self.published = Counter(
            "outboxkit_relay_published_total",
            "Messages acknowledged by Kafka and marked published.",
            registry=r,
        )
        self.failed = Counter(
            "outboxkit_relay_failed_total",
            "Messages Kafka refused for good (dead-lettered or blocking).",
            registry=r,
        )
        self.dead_lettered = Counter(
            "outboxkit_relay_dead_lettered_total",
            "Messages copied to a dead-letter topic.",
            registry=r,
        )
        self.transient_errors = Counter(
            "outboxkit_relay_transient_errors_total",
            "Transient errors the relay retries after, by source: kafka (a batch refused "
            "or not acknowledged for 5 s, once per batch; the producer unable to start) or "
            "postgres (a claim, mark, idle flag or lane heartbeat that failed).",
            ["source"],
            registry=r,
        )
        for source in TRANSIENT_SOURCES:
            self.transient_errors.labels(source)  # exported as 0 before the first error
        self.latency = Histogram(
            "outboxkit_relay_publish_latency_seconds",
            "From the row's creation to Kafka's acknowledgement.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.unsettled_operations = Gauge(
            "outboxkit_relay_unsettled_operations",
            "Operations in the ledger whose outcome is not established: unknown (a reconciler "
            "asks the outside system) or needs-human (a person must resolve them).",
            ["status"],
            registry=r,
        )
        self.lanes_owned = Gauge(
            "outboxkit_relay_lanes_owned", "Lanes this relay publishes.", registry=r
        )
        self.ready = Gauge(
            "outboxkit_relay_ready", "1 while the relay can reach PostgreSQL and Kafka.", registry=r
        )
