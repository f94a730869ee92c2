"""The relay's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from outbox.runtime import MetricFamilies

# Where a transient error came from: the label values of outboxkit_relay_transient_errors_total.
TRANSIENT_SOURCES = ("kafka", "postgres")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RelayMetrics:
    def __init__(self) -> None:
        families = MetricFamilies("relay")
        self.registry = families.registry
        self.backlog = families.gauge(
            "backlog_messages", "Outbox rows waiting to be published (all lanes)."
        )
        self.oldest_pending_age = families.gauge(
            "oldest_pending_age_seconds", "Age of the oldest pending outbox row (0 when none)."
        )
        self.failed_rows = families.gauge(
            "failed_messages", "Outbox rows marked failed, waiting for an operator."
        )
        self.published = families.counter(
            "published_total", "Messages acknowledged by Kafka and marked published."
        )
        self.failed = families.counter(
            "failed_total", "Messages Kafka refused for good (dead-lettered or blocking)."
        )
        self.dead_lettered = families.counter(
            "dead_lettered_total", "Messages copied to a dead-letter topic."
        )
        self.transient_errors = families.counter(
            "transient_errors_total",
            "Transient errors the relay retries after, by source: kafka (a batch refused "
            "or not acknowledged for 5 s, once per batch; the producer unable to start) or "
            "postgres (a claim, mark, idle flag or lane heartbeat that failed).",
            ["source"],
        )
        for source in TRANSIENT_SOURCES:
            self.transient_errors.labels(source)  # exported as 0 before the first error
        self.latency = families.histogram(
            "publish_latency_seconds",
            "From the row's creation to Kafka's acknowledgement.",
            LATENCY_BUCKETS,
        )
        self.unsettled_operations = families.gauge(
            "unsettled_operations",
            "Operations in the ledger whose outcome is not established: unknown (a reconciler "
            "asks the outside system) or needs-human (a person must resolve them).",
            ["status"],
        )
        self.lanes_owned = families.gauge("lanes_owned", "Lanes this relay publishes.")
        self.ready = families.gauge(
            "ready", "1 while the relay can reach PostgreSQL and Kafka."
        )
