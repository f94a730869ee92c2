"""The consumer's Prometheus metrics, in a registry of its own (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

BATCH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ConsumerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.processed = Counter(
            "outboxkit_consumer_processed_total",
            "Messages handled and committed with their dedup mark.",
            ["topic"],
            registry=r,
        )
        self.duplicates = Counter(
            "outboxkit_consumer_duplicates_total",
            "Redelivered messages dropped because their dedup mark was there.",
            ["topic"],
            registry=r,
        )
        self.skipped = Counter(
            "outboxkit_consumer_skipped_total",
            "Messages a handler skipped (SkipMessage).",
            ["topic"],
            registry=r,
        )
        self.failures = Counter(
            "outboxkit_consumer_failures_total",
            "Failed attempts (handler raised, or the message is malformed).",
            ["topic"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "outboxkit_consumer_dead_lettered_total",
            "Messages sent to the dead-letter topic.",
            ["topic"],
            registry=r,
        )
        self.parked = Gauge(
            "outboxkit_consumer_parked_partitions",
            "Partitions held back by a failed message: paused until its retry, or resumed for it.",
            registry=r,
        )
        self.lag = Gauge(
            "outboxkit_consumer_lag_messages",
            "Messages behind the partition's high watermark.",
            ["topic", "partition"],
            registry=r,
        )
        self.lag_total = Gauge(
            "outboxkit_consumer_lag_total_messages",
            "Sum of the lag over the assigned partitions.",
            registry=r,
        )
        self.batch_seconds = Histogram(
            "outboxkit_consumer_batch_seconds",
            "Time to process one poll batch (database commits included).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.purged = Counter(
            "outboxkit_consumer_dedup_purged_total",
            "Dedup marks deleted by retention.",
            registry=r,
        )
        self.ready = Gauge(
            "outboxkit_consumer_ready", "1 while the consumer polls and commits.", registry=r
        )
